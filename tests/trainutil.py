"""Helpers for training tests: a tiny prepared dataset and runs in-process or under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from conftest import REPO

BASE = ["model.preset=micro", "data.seq_len=64", "train.micro_batch=4", "train.steps=10", "optim.warmup_steps=2",
        "log.progress=false", "checkpoint.at_end=false"]


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir) if r["event"] == "step"]


def launch(run_dir: Path, dataset: Path, nproc: int, *sets: str, threads: int = 1, timeout: float = 240,
           max_restarts: int | None = None):
    """Run `hardy train` (nproc == 1) or `hardy launch` (torchrun's elastic agent) in subprocesses.

    With `max_restarts`, even one process goes through `hardy launch`, so the elastic agent restarts it.
    """
    overrides = [*BASE, f"data.path={dataset}", f"train.threads={threads}", *sets]
    args = [arg for s in overrides for arg in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if nproc == 1 and max_restarts is None:
        cmd = [sys.executable, "-m", "hardy", "train", "--run-dir", str(run_dir), *args]
    else:
        cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", str(nproc), "--max-restarts",
               str(max_restarts or 0), "--run-dir", str(run_dir), _empty_config(run_dir.parent), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _empty_config(directory: Path) -> str:
    path = Path(directory) / "empty.toml"
    path.write_text("# every value comes from --set\n")
    return str(path)


def in_process(run_dir: Path, dataset: Path, *sets: str):
    from hardy.train.config import load_config
    from hardy.train.trainer import train

    cfg = load_config(None, [*BASE, f"data.path={dataset}", *sets])
    return train(cfg, run_dir)


def rel_close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def training_state(ckpt_dir):
    """Full (unsharded) model and optimizer tensors of a checkpoint, loaded through DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hardy.checkpoint.manager import verify_manifest
    from hardy.model.config import ModelConfig
    from hardy.model.transformer import Transformer
    from hardy.train.config import config_from_dict
    from hardy.train.setup import make_optimizer

    verify_manifest(ckpt_dir)
    trainer = json.loads((ckpt_dir / "trainer.json").read_text())
    model = Transformer(ModelConfig.from_dict(trainer["config"]["resolved"]["model"]))
    cfg = config_from_dict({k: v for k, v in trainer["config"].items() if k != "resolved"})
    optimizer, _ = make_optimizer(model, cfg)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for key, per_param in state["optim"]["state"].items():
        for name, value in per_param.items():
            flat[f"optim.{key}.{name}"] = value
    return flat


def assert_bitwise_equal(a_dir, b_dir):
    a, b = training_state(a_dir), training_state(b_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key
