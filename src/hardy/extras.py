"""hardy's optional components (pyproject's extras) and the one-line error a command gives when its extra
is not installed: `pip install hardy` runs train, generate, compress and plan; serving, re-ranking, plots
and live recovery each add their own dependencies."""
from __future__ import annotations

import importlib.util

from hardy.errors import HardyError

# extra -> the modules it provides (import names, not distribution names)
EXTRAS = {
    "serve": ("fastapi", "hypercorn", "starlette", "prometheus_client"),
    "rank": ("bm25s", "Stemmer", "ir_measures"),
    "plots": ("matplotlib",),
    "ft": ("torchft",),
    "gpu": ("pynvml",),
    "tensorboard": ("tensorboard",),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here."""
    absent = []
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent that fails to import, or a module without a spec
            found = False
        if not found:
            absent.append(module)
    return absent


def require(extra: str, feature: str) -> None:
    """Raise the one-line error naming the extra `feature` needs, if any of its modules is absent."""
    absent = missing(extra)
    if absent:
        raise HardyError(f"{feature} needs hardy's '{extra}' extra: pip install 'hardy[{extra}]' "
                         f"(not installed: {', '.join(absent)})")
