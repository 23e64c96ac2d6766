"""Hugging Face layout: `config.json` + `model.safetensors` (or shards with an index) + tokenizer files,
for every family in `hardy.formats.families`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hardy.errors import HardyError
from hardy.formats.families import HFNames, config_from_hf, hf_config
from hardy.formats.lazy_weights import LazyWeights, weight_files, write_safetensors
from hardy.formats.tokenizer import HardyTokenizer
from hardy.fsio import atomic_directory
from hardy.model.config import ModelConfig


def read_config(path: Path) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise HardyError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        return config_from_hf(json.loads(cfg_file.read_text()), path)
    except json.JSONDecodeError as e:
        raise HardyError(f"{cfg_file}: malformed JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise HardyError(f"{cfg_file}: not UTF-8 text ({e})") from None


def open_hf_dir(path: str | os.PathLike):
    """(config, LazyWeights, tokenizer or None): the weights stay on disk, in their stored dtype, until a
    tensor is asked for."""
    path = Path(path)
    cfg = read_config(path)
    weights = LazyWeights(path, weight_files(path), HFNames(cfg))
    tokenizer = HardyTokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return cfg, weights, tokenizer


def load_hf_dir(path: str | os.PathLike):
    """Return (config, fp32 state dict in hardy names, tokenizer or None)."""
    cfg, weights, tokenizer = open_hf_dir(path)
    return cfg, {name: weights.get(name) for name in weights.names()}, tokenizer


def save_hf_dir(cfg: ModelConfig, state: dict[str, torch.Tensor], tokenizer, out: str | os.PathLike,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write atomically (a temporary sibling directory, fsync, rename), one tensor in memory at a time."""
    names = HFNames(cfg)
    config = hf_config(cfg, tokenizer.bos_id if tokenizer else None, tokenizer.eos_id if tokenizer else None,
                       str(dtype).removeprefix("torch."))
    kept = {name: t for name, t in state.items() if not (cfg.tie_embeddings and name == "output.weight")}
    entries = [(names.to_hf(name), dtype, tuple(t.shape)) for name, t in kept.items()]
    by_key = {names.to_hf(name): name for name in kept}  # tied: HF re-ties lm_head to embed_tokens
    with atomic_directory(out) as tmp:
        write_safetensors(tmp / "model.safetensors", entries,
                          lambda key: names.write(by_key[key], kept[by_key[key]].detach()).to(dtype).contiguous().cpu(),
                          metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False},
            indent=2))
        if tokenizer is not None:
            tokenizer.save_hf(tmp)
    return Path(out)
