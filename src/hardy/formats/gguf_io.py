"""Read GGUF checkpoints (llama.cpp) into hardy's config, state dict and tokenizer.

`load_gguf` dequantizes every tensor to fp32 with the `gguf` package's reference kernels (training,
compression); `load_gguf_quantized` keeps quantized matrices quantized (inference). llama.cpp's Q/K
row permutation is undone so the weights match the Hugging Face layout hardy's RoPE expects.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from hardy.errors import HardyError
from hardy.formats.gguf_quant import check_unpacks, is_quantized, packed_from_gguf, spec_for
from hardy.formats.gguf_reader import GGUFFile
from hardy.formats.names import check_weights, from_format, to_format, unpermute_qk
from hardy.formats.quantized import QuantSpec
from hardy.formats.tokenizer import tokenizer_from_gguf_fields
from hardy.formats.gguf_families import PERMUTED_QK, config_from_gguf
from hardy.model.config import ModelConfig

def open_gguf(path: str | os.PathLike):
    """The file's header parsed (`hardy.formats.gguf_reader`); tensors are views of its memory map.
    Damaged or truncated files end in a one-line HardyError. One command opens a file several times
    (device choice, config, TP check, load): the parse is kept for the file as it is on disk now."""
    try:
        st = os.stat(path)
    except OSError:
        return GGUFFile(path)  # its own one-line error
    return _open_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int):
    return GGUFFile(path)


def gguf_fields(reader) -> dict:
    """Decoded key/values of a GGUF file (strings, numbers, lists)."""
    return reader.fields


def read_config(reader, path: Path, name: str = "custom") -> ModelConfig:
    """The model config of an opened GGUF file (tied when it has no LM head of its own)."""
    names = [t.name for t in reader.tensors]
    cfg = config_from_gguf(reader.fields, path, name, names)
    return cfg.replace(tie_embeddings="output.weight" not in names)


def qk_heads(cfg: ModelConfig, arch: str, name: str) -> int | None:
    """The head count whose rows llama.cpp interleaved in tensor `name` (hardy name), where it did."""
    if arch not in PERMUTED_QK:
        return None
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return cfg.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return cfg.n_kv_heads
    return None


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor as fp32 in PyTorch (row-major) shape."""
    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise HardyError(f"GGUF tensor {t.name}: type {t.tensor_type.name} is not supported") from None
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = values.copy()  # F32/F16 tensors come back as views of the read-only memmap
    return torch.from_numpy(values)


def check_shapes(cfg: ModelConfig, tensors, path: Path) -> None:
    """A GGUF's tensor infos against its metadata, before any tensor is converted."""
    shapes = {}
    for t in tensors:
        ours = from_format(t.name, "gguf")
        if ours is None:
            continue
        if ours in shapes:
            raise HardyError(f"{path}: tensor {t.name} appears twice")
        shapes[ours] = tuple(int(d) for d in reversed(t.shape))
    check_weights(cfg, shapes, path, optional=("output.weight",),  # untied heads are decided by its presence
                  describe=lambda name: to_format(name, "gguf"))


def load_gguf(path: str | os.PathLike, name: str = "custom"):
    """Return (config, fp32 state dict in hardy names, tokenizer, metadata fields)."""
    path = Path(path)
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    cfg = read_config(reader, path, name)
    check_shapes(cfg, reader.tensors, path)
    tokenizer = tokenizer_from_gguf_fields(fields, path)
    state = {}
    for t in reader.tensors:
        ours = from_format(t.name, "gguf")
        if ours is None:
            continue  # e.g. rope_freqs.weight: hardy derives the factors from metadata
        w = dequantize_tensor(t)
        heads = qk_heads(cfg, fields["general.architecture"], ours)
        state[ours] = unpermute_qk(w, heads) if heads else w
    return cfg, state, tokenizer, fields


def load_gguf_quantized(path: str | os.PathLike, name: str = "custom", progress: bool = False, tp_slices=None,
                        converter=None):
    """Return (config, float state, {hardy name: PackedQuant}, tokenizer, {GGUF type: count}).

    Quantized matrices go into hardy's format tensor by tensor from the memory-mapped file
    (`hardy.formats.gguf_quant`); only 1-D tensors and float matrices are read as float.
    `tp_slices(hardy name) -> TPSlice | None`: a tensor-parallel rank reads only its part of those
    matrices (hardy.compress.tensor_parallel.rank_slices). `converter`: the compiled converters
    (hardy.compress.kernels.load()) that write the kernels' layout in one pass; None: numpy.
    """
    path = Path(path)
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    cfg = read_config(reader, path, name)
    check_shapes(cfg, reader.tensors, path)
    tokenizer = tokenizer_from_gguf_fields(fields, path)
    state, quantized, types = {}, {}, {}
    tensors = [(t, from_format(t.name, "gguf")) for t in reader.tensors]
    tensors = [(t, ours) for t, ours in tensors if ours is not None]
    with _progress(len(tensors), progress, f"loading {path.name}") as bar:
        for t, ours in tensors:
            heads = qk_heads(cfg, fields["general.architecture"], ours)
            if is_quantized(t):
                reader.prefetch(t)
                q = packed_from_gguf(t, heads, tp_slices(ours) if tp_slices else None, converter)
                check_unpacks(q, f"{path}: {t.name}")
                quantized[ours] = q
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            else:
                w = dequantize_tensor(t)
                state[ours] = unpermute_qk(w, heads) if heads else w
            reader.release(t)
            bar.update(1)
    return cfg, state, quantized, tokenizer, types


def _progress(total: int, enabled: bool, desc: str):
    return tqdm(total=total, unit="tensor", desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def native_layout(path) -> list[tuple[str, QuantSpec, tuple[int, int]]]:
    """(hardy name, spec, shape) of every matrix a native load quantizes, read from the header only."""
    out = []
    for t in open_gguf(path).tensors:
        ours = from_format(t.name, "gguf")
        if ours is not None and is_quantized(t):
            out.append((ours, spec_for(t.tensor_type.name), (int(t.shape[1]), int(t.shape[0]))))
    return out
