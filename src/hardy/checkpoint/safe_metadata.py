"""DCP's `.metadata` is a pickle, and a checkpoint directory may come from someone else: the
manifest's checksums prove integrity, not authenticity, so unpickling a received run would run
whatever code its author put there. Before DCP reads the file, hardy unpickles it with an allow-list:
DCP's own metadata classes, `torch.Size`, torch's dtype / layout / memory-format constants, path
objects and plain containers. Anything else ends the load with a one-line error (exit 2) before a
single object of the file is built by DCP.
"""
from __future__ import annotations

import io
from pathlib import Path
from pickle import Unpickler, UnpicklingError

import torch
from torch.distributed.checkpoint import FileSystemReader

from hardy.errors import HardyError

METADATA = ".metadata"
# modules whose own classes (and only those: not what they import) a DCP metadata file may name
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PLAIN = {("builtins", n) for n in ("dict", "list", "tuple", "set", "frozenset", "slice")} | {
    ("collections", "OrderedDict"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch.strided pickles: a name looked up in a table
    # StorageMeta.checkpoint_id: a path object is built from its parts, nothing else
    *(("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
# the largest metadata file read (a 405B model's has ~10^5 entries: well under this)
MAX_METADATA_BYTES = 1 << 30


class _MetadataUnpickler(Unpickler):
    def __init__(self, data: bytes, where: Path):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise HardyError(f"{self.where}: the checkpoint metadata refers to {module}.{name}, which DCP metadata "
                         "never holds; refusing to load it (was this checkpoint written by hardy?)")


def check_dcp_metadata(directory: Path, name: str = METADATA) -> None:
    """Unpickle `directory`/.metadata with the allow-list; a one-line HardyError if it names
    anything else or is not a pickle at all."""
    path = Path(directory) / name
    try:
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise HardyError(f"{path}: {size} bytes is not a checkpoint's metadata")
        data = path.read_bytes()
    except OSError as e:
        raise HardyError(f"{path}: cannot read the checkpoint metadata ({e.strerror})") from None
    try:
        _MetadataUnpickler(data, path).load()
    except HardyError:
        raise
    except (UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError) as e:
        raise HardyError(f"{path}: the checkpoint metadata is damaged ({type(e).__name__})") from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, with the metadata checked by `check_dcp_metadata` first."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")  # newer DCP may keep one metadata file per rank: __<rank>.metadata
        check_dcp_metadata(Path(self.path), METADATA if rank is None else f"__{rank}{METADATA}")
        return super().read_metadata(*args, **kwargs)
