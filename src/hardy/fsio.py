"""Durable file writes: write to a temporary name, fsync, rename over the target."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path

from hardy.errors import HardyError


def cache_dir(name: str) -> Path:
    """hardy's per-user cache for `name` (kernels, models, matmul): under HARDY_CACHE, by default
    ~/.cache/hardy. Not created here."""
    return Path(os.environ.get("HARDY_CACHE", Path.home() / ".cache" / "hardy")) / name


def parse_json_lines(text: str) -> list[dict]:
    """The JSON objects of an append-only log, one per line (metrics.jsonl, telemetry and hang files).
    A line cut short is skipped: a writer killed mid-line leaves one, and the next writer appends after
    it, so it can sit anywhere. So is a value that is not an object."""
    out = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """parse_json_lines of a file; [] where there is none."""
    path = Path(path)
    return parse_json_lines(path.read_text(errors="replace")) if path.is_file() else []


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
    # a name of this writer's own: two writers of one path (two ranks, a retry beside a late first try)
    # must not truncate each other's bytes or rename each other's file away
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
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
