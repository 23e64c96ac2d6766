"""Durable file writes: write to a temporary name, fsync, rename over the target."""
from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """durable=False skips the fsync: for files a later step fsyncs before marking them complete."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict, durable: bool = True) -> None:
    write_bytes_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode(), durable)
