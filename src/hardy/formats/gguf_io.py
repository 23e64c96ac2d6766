"""Read GGUF checkpoints (llama.cpp) into hardy's config, state dict and tokenizer.

Tensors are dequantized with the `gguf` package's reference kernels; llama.cpp's Q/K row
permutation is undone so the weights match the Hugging Face layout hardy's RoPE expects.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from hardy.errors import HardyError
from hardy.formats.names import from_format, unpermute_qk
from hardy.model.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama",)


def open_gguf(path: str | os.PathLike):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise HardyError(f"model file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/KeyError/IndexError on damaged headers
        raise HardyError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    # A truncated file can still parse its header: check that every tensor's bytes are present.
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise HardyError(f"{path}: truncated GGUF file (tensor {t.name} ends at byte "
                             f"{t.data_offset + t.n_bytes}, file has {size})")
    return reader


def gguf_fields(reader) -> dict:
    """Decoded key/values of a GGUF file (strings, numbers, lists)."""
    out = {}
    for key, f in reader.fields.items():
        try:
            out[key] = f.contents()
        except Exception:  # an exotic field type hardy does not use
            continue
    return out


def config_from_gguf(fields: dict, path: Path, name: str = "custom") -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HardyError(f"{path}: unsupported GGUF architecture {arch!r} "
                         f"(hardy supports: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise HardyError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or [])
    head_dim = fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count")
    scaling = None
    if fields.get(f"{arch}.rope.scaling.type") == "llama3" or fields.get(f"{arch}.rope.scaling.factor"):
        scaling = RopeScaling(
            factor=float(get("rope.scaling.factor")),
            low_freq_factor=float(fields.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(fields.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
            original_max_position=int(fields.get(f"{arch}.rope.scaling.original_context_length", 8192)))
    return ModelConfig(
        vocab_size=int(vocab), dim=dim, n_layers=int(get("block_count")), n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)), ffn_dim=int(get("feed_forward_length")),
        head_dim=int(head_dim) if head_dim and int(head_dim) != dim // n_heads else None,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_seq_len=int(get("context_length", 2048)), tie_embeddings=False, name=name)


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor as fp32 in PyTorch (row-major) shape."""
    import gguf

    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise HardyError(f"GGUF tensor {t.name}: type {t.tensor_type.name} is not supported") from None
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = values.copy()  # F32/F16 tensors come back as views of the read-only memmap
    return torch.from_numpy(values)


def load_gguf(path: str | os.PathLike, name: str = "custom"):
    """Return (config, fp32 state dict in hardy names, tokenizer, metadata fields)."""
    from hardy.formats.tokenizer import tokenizer_from_gguf_fields

    path = Path(path)
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    cfg = config_from_gguf(fields, path, name)
    state = {}
    for t in reader.tensors:
        ours = from_format(t.name, "gguf")
        if ours is None:
            continue  # e.g. rope_freqs.weight: hardy derives the factors from metadata
        w = dequantize_tensor(t)
        if ours.endswith("attention.wq.weight"):
            w = unpermute_qk(w, cfg.n_heads)
        elif ours.endswith("attention.wk.weight"):
            w = unpermute_qk(w, cfg.n_kv_heads)
        state[ours] = w
    cfg = cfg.replace(tie_embeddings="output.weight" not in state)
    tokenizer = tokenizer_from_gguf_fields(fields)
    return cfg, state, tokenizer, fields
