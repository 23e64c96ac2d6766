"""What a run is built from before its first step: the dataset (prepared once, by the main rank),
the model config (a preset, or a fine-tune's source and its weights) and the optimizer with its
learning-rate schedule."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from hardy.data.prepare import INDEX_FILE
from hardy.errors import HardyError
from hardy.loading.load import load_model
from hardy.model.config import ModelConfig, get_preset
from hardy.parallel import distributed as D
from hardy.train.config import TrainConfig


def prepare_dataset(cfg: TrainConfig, run_dir: Path, env: D.DistEnv) -> Path:
    """data.path as given, or data.inputs prepared once into RUN_DIR/data (rank 0; others wait).

    Preparation runs in a child process so its memory peak does not count as the trainer's.
    """
    if cfg.data.path:
        return Path(cfg.data.path)
    target = run_dir / "data"

    def work():
        if (target / INDEX_FILE).exists():
            return
        cmd = [sys.executable, "-m", "hardy", "data", "prepare", "--input", *cfg.data.inputs,
               "--tokenizer", cfg.data.tokenizer, "--out", str(target), "--val-fraction", str(cfg.data.val_fraction),
               "--seed", str(cfg.train.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            print(f"data: {line}", flush=True)
        if proc.returncode:
            raise HardyError(proc.stderr.strip().removeprefix("hardy: error: ") or "data preparation failed")

    # The others wait on the store, not in a barrier: a big corpus takes longer than a collective's timeout.
    D.main_rank_does("prepare-dataset", work, env.rank, cfg.fault.startup_timeout_s or 7 * 86400)
    return target


def resolve_model_config(cfg: TrainConfig, vocab_size: int) -> tuple[ModelConfig, dict | None]:
    """The model config and, when fine-tuning, the pretrained weights (full tensors)."""
    if cfg.model.init_from:
        loaded = load_model(cfg.model.init_from)
        mcfg = loaded.config
        if mcfg.vocab_size < vocab_size:
            raise HardyError(f"the data's tokenizer has {vocab_size} tokens but {cfg.model.init_from} has "
                             f"{mcfg.vocab_size}: prepare the data with the model's tokenizer")
        return mcfg.replace(dropout=cfg.model.dropout), loaded.model.state_dict()
    mcfg = get_preset(cfg.model.preset)
    if cfg.model.n_layers:
        mcfg = mcfg.first_layers(cfg.model.n_layers, name=f"{mcfg.name}[:{cfg.model.n_layers} layers]")
    # the vocabulary comes from the data's tokenizer; dropout is a training choice
    return mcfg.replace(vocab_size=vocab_size, dropout=cfg.model.dropout), None


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    # Weight decay on matrices only. Plain tensors and DTensors go in separate groups: the foreach
    # kernels run per group and cannot mix the two (tensor parallelism leaves norms/embeddings plain).
    groups: dict[tuple[bool, bool], list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [{"params": ps, "weight_decay": o.weight_decay if decay else 0.0} for (decay, _), ps in groups.items()],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)  # default kernel: per-tensor on CPU (no big temporaries)
    total, warmup = cfg.train.steps, o.warmup_steps

    def lr_factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
