"""Safetensors weights one tensor at a time: a lazy reader over a Hugging Face directory's files (a
tensor is read with pread when asked for, in its stored dtype; the files are not memory-mapped, so
pages read stay out of the process's resident memory) and a streaming writer that never holds more
than one tensor (`safetensors.torch.save_file` takes them all at once: 16 GB of bf16 for an 8B model).

The writer follows the format's specification (huggingface/safetensors): an 8-byte little-endian
header length, the JSON header (dtype, shape, data offsets per tensor; padded with spaces to a
multiple of 8), then the tensors' bytes in header order. Files it writes are read back by the
`safetensors` package itself (tested)."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable

import torch

from hardy.errors import HardyError
from hardy.formats.families import HFNames
from hardy.fsio import atomic_file

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int8: "I8",
               torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}
TORCH_DTYPES = {**{v: k for k, v in DTYPE_NAMES.items()}, "F64": torch.float64, "BOOL": torch.bool}
MAX_HEADER = 100 * 2 ** 20  # the format's own limit on the JSON header


class SafetensorsFile:
    """One safetensors file's header, and reads of its tensors with pread: the file is not mapped,
    so what a compression has read of an 8B model does not stay in its resident memory (with
    `safe_open`'s map, each tensor's pages stayed: RSS grew by the file's 16 GB)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
            size = os.fstat(self.fd).st_size
            n = struct.unpack("<Q", os.pread(self.fd, 8, 0))[0] if size >= 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} in a {size}-byte file")
            header = json.loads(os.pread(self.fd, n, 8))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError, struct.error) as e:
            raise HardyError(f"{path}: cannot read safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for key, info in header.items():
            try:
                dtype, shape = TORCH_DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"])
                begin, end = (int(v) for v in info["data_offsets"])
                nbytes = torch.Size(shape).numel() * dtype.itemsize
                if any(d < 0 for d in shape) or end - begin != nbytes or begin < 0 or 8 + n + end > size:
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise HardyError(f"{path}: tensor {key!r} has a malformed header entry {info!r}") from None
            self.tensors[key] = (dtype, shape, 8 + n + begin, nbytes)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def read(self, key: str, first_row: int = 0, rows: int | None = None) -> torch.Tensor:
        dtype, shape, offset, nbytes = self.tensors[key]
        if rows is not None:  # a range of rows of a 2-D (or higher) tensor
            row_bytes = nbytes // shape[0] if shape and shape[0] else 0
            offset, nbytes, shape = offset + first_row * row_bytes, rows * row_bytes, (rows, *shape[1:])
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise HardyError(f"{self.path}: tensor {key} is cut short (file truncated?)")
            done += got
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class LazyWeights:
    """hardy name -> tensor, read from the directory's safetensors files only when asked for. `names`
    (hardy.formats.families.HFNames): the family's tensor names and value conventions; None: Llama's."""

    def __init__(self, path: Path, files: Iterable[str], names=None):
        self.path = Path(path)
        self.hf_names = names or HFNames()
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, tuple[str, str]] = {}  # hardy name -> (file, key in the file)
        for name in files:
            file = self.path / name
            if not file.is_file():
                raise HardyError(f"{self.path}: missing weights file {name}")
            self._files[name] = SafetensorsFile(file)
            for key in self._files[name].tensors:
                ours = self.hf_names.from_hf(key)
                if ours is not None:
                    self._where[ours] = (name, key)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _locate(self, name: str) -> tuple[SafetensorsFile, str]:
        if name not in self._where:
            raise HardyError(f"{self.path}: no weights for {name}")
        file, key = self._where[name]
        return self._files[file], key

    def get(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor (read from the file now), converted to `dtype` (None: as stored)."""
        file, key = self._locate(name)
        t = self.hf_names.read(name, file.read(key))
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def rows(self, name: str, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) of a 2-D tensor, reading only those bytes."""
        file, key = self._locate(name)
        rows = self.shape(name)[0]
        if not 0 <= start <= stop <= rows:
            raise HardyError(f"{self.path}: rows {start}:{stop} of {name} (it has {rows})")
        return self.hf_names.read(name, file.read(key, start, stop - start)).to(dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self._locate(name)
        return file.tensors[key][1]


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
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out = Path(out)
    with atomic_file(out) as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape in entries:
            t = make(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise HardyError(f"safetensors writer: {name} is {t.dtype} {tuple(t.shape)}, "
                                 f"the header says {dtype} {tuple(shape)}")
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return out
