"""Durable file writes: write to a temporary name, fsync, rename over the target."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from hardy.errors import HardyError


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, durable: bool = True):
    """An open binary file whose contents appear at `path` only once the block completes (temporary
    sibling, fsync unless durable=False, rename); on an exception the temporary is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """durable=False skips the fsync: for files a later step fsyncs before marking them complete."""
    with atomic_file(path, durable) as f:
        f.write(data)


def write_json_atomic(path: Path, data: dict, durable: bool = True) -> None:
    write_bytes_atomic(path, json.dumps(data, indent=1, sort_keys=True).encode(), durable)


def check_new_output(out: str | os.PathLike) -> None:
    """A one-line error unless `out` is free for `atomic_directory` (absent, or an empty directory):
    called before long work too, so a taken output is refused before the work, not after it."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HardyError(f"output {out} already exists and is not an empty directory")


@contextmanager
def atomic_directory(out: str | os.PathLike):
    """Build a directory under a temporary sibling name, then fsync its files and rename it into
    place; on any error nothing is left behind. `out` must not exist or be an empty directory."""
    out = Path(out)
    check_new_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        for f in tmp.iterdir():
            fsync_path(f)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
