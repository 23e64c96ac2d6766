"""Reading text inputs: a path, or the name of a bundled corpus (wikitext2-test, ...)."""
from __future__ import annotations

from pathlib import Path

from hardy.errors import HardyError

CORPORA_DIR = Path(__file__).parent / "corpora"
BUNDLED = ("wikitext2-test", "wikitext2-valid", "tinyshakespeare")


def resolve_text_path(spec: str) -> Path:
    path = Path(spec)
    if path.exists():
        return path
    if spec in BUNDLED:
        return CORPORA_DIR / f"{spec}.txt"
    raise HardyError(f"data file not found: {spec} (bundled corpora: {', '.join(BUNDLED)})")


def read_text(spec: str) -> str:
    path = resolve_text_path(spec)
    if path.is_dir():
        raise HardyError(f"data path is a directory, expected a text file: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except PermissionError:
        raise HardyError(f"data file is not readable: {path}") from None
    except UnicodeDecodeError as e:
        raise HardyError(f"data file is not UTF-8 text: {path} (byte {e.start})") from None
    except OSError as e:
        raise HardyError(f"cannot read data file {path}: {e.strerror}") from None
