"""Hugging Face Llama layout: `config.json` + `model.safetensors` (+ shards) + tokenizer files."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hardy.errors import HardyError
from hardy.formats.lazy_weights import LazyWeights, weight_files
from hardy.formats.names import to_format
from hardy.formats.tokenizer import HardyTokenizer
from hardy.fsio import atomic_directory
from hardy.model.config import ModelConfig, RopeScaling


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, dtype: str = "float32") -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope if cfg.rope_scaling else None,
        "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": dtype, "hardy_preset": cfg.name,
    }


INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "head_dim", "max_position_embeddings")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def config_from_hf(data: dict, path: Path) -> ModelConfig:
    if not isinstance(data, dict):
        raise HardyError(f"{path}: config.json must hold a JSON object")
    if data.get("model_type") != "llama":
        raise HardyError(f"{path}: unsupported model_type {data.get('model_type')!r} (hardy supports 'llama')")
    for key in INT_KEYS:  # a string or a float where a count belongs would fail far from here
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise HardyError(f"{path}: config.json {key} = {value!r} is not an integer")
    for key in FLOAT_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise HardyError(f"{path}: config.json {key} = {value!r} is not a number")
    try:
        return _config(data)
    except KeyError as e:
        raise HardyError(f"{path}: config.json lacks {e.args[0]}") from None
    except HardyError as e:  # the config's own checks: say which file
        raise HardyError(f"{path}: {e}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise HardyError(f"{path}: bad config.json ({type(e).__name__}: {e})") from None


def _config(data: dict) -> ModelConfig:
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
    theta = data.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = None
    if rope.get("rope_type", rope.get("type")) == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_position=int(rope["original_max_position_embeddings"]))
    n_heads, dim = data["num_attention_heads"], data["hidden_size"]
    head_dim = data.get("head_dim")
    return ModelConfig(
        vocab_size=data["vocab_size"], dim=dim, n_layers=data["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=data.get("num_key_value_heads") or n_heads, ffn_dim=data["intermediate_size"],
        head_dim=head_dim if head_dim and head_dim != dim // n_heads else None,
        norm_eps=float(data.get("rms_norm_eps") or 1e-5), rope_theta=float(theta), rope_scaling=scaling,
        max_seq_len=data.get("max_position_embeddings") or 2048,
        tie_embeddings=bool(data.get("tie_word_embeddings", False)), name=str(data.get("hardy_preset", "custom")))


def open_hf_dir(path: str | os.PathLike):
    """(config, LazyWeights, tokenizer or None): the weights stay on disk until a tensor is asked for."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HardyError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        cfg = config_from_hf(json.loads(cfg_file.read_text()), path)
    except json.JSONDecodeError as e:
        raise HardyError(f"{cfg_file}: malformed JSON ({e})") from None
    weights = LazyWeights(path, weight_files(path))
    tokenizer = HardyTokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return cfg, weights, tokenizer


def load_hf_dir(path: str | os.PathLike):
    """Return (config, fp32 state dict in hardy names, tokenizer or None)."""
    cfg, weights, tokenizer = open_hf_dir(path)
    return cfg, {name: weights.get(name) for name in weights.names()}, tokenizer


def save_hf_dir(cfg: ModelConfig, state: dict[str, torch.Tensor], tokenizer, out: str | os.PathLike,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write atomically: build in a temporary sibling directory, fsync, then rename into place."""
    with atomic_directory(out) as tmp:
        tensors = {}
        for name, t in state.items():
            if cfg.tie_embeddings and name == "output.weight":
                continue  # tied: HF re-ties lm_head to embed_tokens
            tensors[to_format(name, "hf")] = t.detach().to(dtype).contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        bos = tokenizer.bos_id if tokenizer else None
        eos = tokenizer.eos_id if tokenizer else None
        dtype_name = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, bos, eos, dtype_name), indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, indent=2))
        if tokenizer is not None:
            tokenizer.save_hf(tmp)
    return Path(out)
