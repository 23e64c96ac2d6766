"""Safetensors weights one tensor at a time: a lazy reader over a Hugging Face directory's files
(memory-mapped by `safetensors.safe_open`; a tensor is read when asked for, in its stored dtype) and
a streaming writer that never holds more than one tensor (`safetensors.torch.save_file` takes them
all at once: 16 GB of bf16 for an 8B model).

The writer follows the format's specification (huggingface/safetensors): an 8-byte little-endian
header length, the JSON header (dtype, shape, data offsets per tensor; padded with spaces to a
multiple of 8), then the tensors' bytes in header order. Files it writes are read back by the
`safetensors` package itself (tested)."""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open

from hardy.errors import HardyError
from hardy.formats.names import from_format

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
               torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}


class LazyWeights:
    """hardy name -> tensor, read from the directory's safetensors files only when asked for."""

    def __init__(self, path: Path, files: Iterable[str]):
        self.path = Path(path)
        self._handles = {}
        self._where: dict[str, tuple[str, str]] = {}  # hardy name -> (file, key in the file)
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise HardyError(f"{self.path}: missing weights file {name}")
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise HardyError(f"{file}: cannot read safetensors file ({e})") from None
            self._handles[name] = handle
            for key in handle.keys():
                ours = from_format(key, "hf")
                if ours is not None:
                    self._where[ours] = (name, key)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor (a fresh copy out of the mapped file), converted to `dtype` (None: as stored)."""
        if name not in self._where:
            raise HardyError(f"{self.path}: no weights for {name}")
        file, key = self._where[name]
        try:
            t = self._handles[file].get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise HardyError(f"{self.path / file}: cannot read tensor {key} ({e})") from None
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, reading only those bytes."""
        file, key = self._where[name]
        return self._handles[file].get_slice(key)[start:stop].to(dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self._where[name]
        return tuple(self._handles[file].get_slice(key).get_shape())


def weight_files(path: Path) -> list[str]:
    """The safetensors files of a Hugging Face directory (sharded: from its index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise HardyError(f"{index}: malformed index ({e})") from None
    return ["model.safetensors"]


def write_safetensors(out: str | os.PathLike, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      make: Callable[[str], torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write `out` atomically with one tensor in memory at a time: `entries` (name, dtype, shape) fix
    the header up front; `make(name)` produces each tensor when its turn comes."""
    header, offset = {}, 0
    for name, dtype, shape in entries:
        if dtype not in DTYPE_NAMES:
            raise HardyError(f"safetensors writer: unsupported dtype {dtype} for {name}")
        size = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, dtype, shape in entries:
                t = make(name)
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise HardyError(f"safetensors writer: {name} is {t.dtype} {tuple(t.shape)}, "
                                     f"the header says {dtype} {tuple(shape)}")
                if t.numel():
                    f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
