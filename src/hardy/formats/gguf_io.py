"""Read GGUF checkpoints (llama.cpp) into hardy's config, state dict and tokenizer.

`load_gguf` dequantizes every tensor to fp32 with the `gguf` package's reference kernels (training,
compression); `load_gguf_quantized` keeps quantized matrices quantized (inference). llama.cpp's Q/K
row permutation is undone so the weights match the Hugging Face layout hardy's RoPE expects.
"""
from __future__ import annotations

import functools
import os
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import torch
from tqdm import tqdm

from hardy.errors import HardyError
from hardy.formats.gguf_quant import check_unpacks, is_quantized, packed_from_gguf, spec_for
from hardy.formats.gguf_reader import GGUFFile
from hardy.formats.names import STACKED, check_weights, expert_names, from_format, stacked_name, to_format, unpermute_qk
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


def close_gguf_files() -> None:
    """Drop the kept parses, so their memory maps (metadata and any tensor pages read through them)
    leave the process once a load has taken what it needs."""
    _open_cached.cache_clear()


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


def gguf_name(ours: str) -> str:
    """The file's name of a hardy tensor (an expert's: the stacked tensor and the expert's index)."""
    stacked = stacked_name(ours)
    if stacked is None:
        return to_format(ours, "gguf")
    return f"{to_format(stacked, 'gguf')}[expert {ours.split('.experts.')[1].split('.')[0]}]"


def split_experts(t, n_experts: int | None, path) -> list:
    """A stacked expert tensor [experts, rows, columns] as one 2-D tensor view per expert (the bytes
    stay in the memory map)."""
    dims = [int(d) for d in t.shape]
    if n_experts is None:
        raise HardyError(f"{path}: tensor {t.name} holds experts; the metadata declares none")
    if len(dims) != 3 or dims[2] != n_experts:
        raise HardyError(f"{path}: tensor {t.name} has shape {tuple(reversed(dims))}, the metadata says "
                         f"{n_experts} experts (expected [{n_experts}, rows, columns])")
    size = t.n_bytes // n_experts
    return [replace(t, shape=t.shape[:2].copy(), data_offset=t.data_offset + e * size, n_bytes=size, data=t.data[e])
            for e in range(n_experts)]


def hardy_tensors(cfg: ModelConfig, tensors, path) -> list[tuple[object, str]]:
    """(tensor, hardy name) of every tensor hardy reads, stacked experts split one entry per expert."""
    out = []
    for t in tensors:
        ours = from_format(t.name, "gguf")
        if ours is None:
            continue
        if STACKED.fullmatch(ours):
            out += zip(split_experts(t, cfg.moe.n_experts if cfg.moe else None, path), expert_names(ours, int(t.shape[-1])))
        elif ours.endswith("shared_gate.weight") and len(t.shape) == 1:  # llama.cpp stores the gate as a vector
            out.append((replace(t, shape=np_2d(t.shape), data=t.data.reshape(1, -1)), ours))
        else:
            out.append((t, ours))
    return out


def np_2d(shape):
    return np.array([int(shape[0]), 1], dtype=np.uint64)


def check_shapes(cfg: ModelConfig, tensors, path: Path) -> None:
    """A GGUF's tensor infos against its metadata, before any tensor is converted."""
    shapes = {}
    for t, ours in hardy_tensors(cfg, tensors, path):
        if ours in shapes:
            raise HardyError(f"{path}: tensor {t.name} appears twice")
        shapes[ours] = tuple(int(d) for d in reversed(t.shape))
    check_weights(cfg, shapes, path, optional=("output.weight",),  # untied heads are decided by its presence
                  describe=gguf_name)


def load_gguf(path: str | os.PathLike, name: str = "custom"):
    """Return (config, fp32 state dict in hardy names, tokenizer, metadata fields)."""
    path = Path(path)
    reader = open_gguf(path)
    fields = gguf_fields(reader)
    cfg = read_config(reader, path, name)
    check_shapes(cfg, reader.tensors, path)
    tokenizer = tokenizer_from_gguf_fields(fields, path)
    state = {}
    for t, ours in hardy_tensors(cfg, reader.tensors, path):  # not rope_freqs: hardy derives it from metadata
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
    tensors = hardy_tensors(cfg, reader.tensors, path)
    with _progress(len(tensors), progress, f"loading {path.name}") as bar:
        for t, ours in tensors:
            heads = qk_heads(cfg, fields["general.architecture"], ours)
            if is_quantized(t):
                q = packed_from_gguf(t, heads, tp_slices(ours) if tp_slices else None, converter, reader.rows(t))
                check_unpacks(q, f"{path}: {t.name}")
                quantized[ours] = q
                types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
            else:
                w = dequantize_tensor(t)
                state[ours] = unpermute_qk(w, heads) if heads else w
            reader.release_read(t)
            bar.update(1)
    return cfg, state, quantized, tokenizer, types


def _progress(total: int, enabled: bool, desc: str):
    return tqdm(total=total, unit="tensor", desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def native_layout(path) -> list[tuple[str, QuantSpec, tuple[int, int]]]:
    """(hardy name, spec, shape) of every matrix a native load quantizes, read from the header only."""
    out, reader = [], open_gguf(path)
    for t, ours in hardy_tensors(read_config(reader, Path(path)), reader.tensors, path):
        if is_quantized(t):
            out.append((ours, spec_for(t.tensor_type.name), (int(t.shape[1]), int(t.shape[0]))))
    return out
