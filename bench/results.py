"""The result files behind BENCHMARKS.md's table of current figures: one JSON file per claimed goal in
bench/results/, written by the bench script that measured it (`--record`) and read by bench/summary.py.

A file holds one measurement: the goal and its bound on the ratio, hardy's figure, the baseline's, the
ratio's median and 95% interval, how many alternating repetitions, the CPU, the date and the exact command.
Rows that predate the table were transcribed from the history log (bench/history.md) and say so
(`"source": "history"`) until their script records them again.
"""
from __future__ import annotations

import datetime
import json
import re
import shlex
import sys
from pathlib import Path

from hardy.fsio import write_bytes_atomic

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = ("id", "issue", "goal", "target", "figure", "baseline", "ratio", "unit", "runs", "alternating", "cpu",
        "date", "command", "source", "note")


def this_command() -> str:
    """The command line that is running, as someone would retype it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(Path(__file__).resolve().parent.parent)
    except ValueError:
        pass
    return shlex.join([".venv/bin/python", str(script), *sys.argv[1:]])


def slug(name: str) -> str:
    """A model path or name as part of a result id: `/tmp/big/llama3.1-8b.Q4_0.gguf` -> `llama3-1-8b-q4-0`."""
    stem = Path(name).name.removesuffix(".gguf")
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")


def record(result_id: str, *, issue: int, goal: str, target: tuple[str, float] | None, figure: str,
           baseline: str | None, ratio: tuple[float, float, float], runs: int, note: str = "", digits: int = 2,
           unit: str = "×", alternating: bool = True, command: str | None = None,
           directory: Path = RESULTS) -> Path:
    """Write (atomically) the result file of one goal; `ratio` is (median, low, high) of the alternating
    repetitions' ratios and `target` the goal's bound on it, e.g. (">=", 1.25); for a goal on an amount
    (seconds, a percentage) `ratio` holds the amount and `unit` its unit. `runs` 0: a deterministic
    computation (a planner evaluation), judged on its value alone, with no interval. `command`: the
    measured command where it is not this script's (the test suite's wall time: `make test`)."""
    from native import cpu_line

    if target is not None and target[0] not in (">=", "<="):
        raise ValueError(f"a target bound is '>=' or '<=', not {target[0]!r}")
    med, lo, hi = (None if x is None else round(float(x), digits) for x in ratio)  # as the scripts print them
    result = {
        "id": result_id, "issue": issue, "goal": goal,
        "target": None if target is None else {"op": target[0], "value": target[1]},
        "figure": figure, "baseline": baseline,
        "ratio": {"median": med, "low": lo, "high": hi}, "unit": unit, "runs": runs, "alternating": alternating,
        "cpu": cpu_line(), "date": datetime.date.today().isoformat(), "command": command or this_command(),
        "source": "bench", "note": note,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result_id}.json"
    write_bytes_atomic(path, (json.dumps(result, indent=2, ensure_ascii=False) + "\n").encode())
    print(f"recorded {path.relative_to(directory.parent) if directory.parent in path.parents else path}", flush=True)
    return path


def load_all(directory: Path = RESULTS) -> list[dict]:
    """Every result file, in file-name order; a file missing a key or holding something else is an error
    naming it (the table must not silently lose a row)."""
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path}: not a readable JSON result ({e})")
        missing = [k for k in KEYS if not isinstance(result, dict) or k not in result]
        if missing:
            raise SystemExit(f"{path}: a result file needs {', '.join(missing)}")
        if result["id"] != path.stem:
            raise SystemExit(f"{path}: its id is {result['id']!r}, not its file name")
        out.append(result)
    return out
