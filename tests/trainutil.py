"""Helpers for training tests: a tiny prepared dataset and runs in-process or under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

BASE = ["model.preset=micro", "data.seq_len=64", "train.micro_batch=4", "train.steps=10", "optim.warmup_steps=2",
        "log.progress=false", "checkpoint.at_end=false"]


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir) if r["event"] == "step"]


def launch(run_dir: Path, dataset: Path, nproc: int, *sets: str, threads: int = 1, timeout: float = 240,
           max_restarts: int | None = None):
    """Run `hardy train` (nproc == 1) or `hardy launch` (torchrun's elastic agent) in subprocesses.

    With `max_restarts`, even one process goes through `hardy launch`, so the elastic agent restarts it.
    """
    overrides = [*BASE, f"data.path={dataset}", f"train.threads={threads}", *sets]
    args = [arg for s in overrides for arg in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    if nproc == 1 and max_restarts is None:
        cmd = [sys.executable, "-m", "hardy", "train", "--run-dir", str(run_dir), *args]
    else:
        cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", str(nproc), "--max-restarts",
               str(max_restarts or 0), "--run-dir", str(run_dir), _empty_config(run_dir.parent), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _empty_config(directory: Path) -> str:
    path = Path(directory) / "empty.toml"
    path.write_text("# every value comes from --set\n")
    return str(path)


def in_process(run_dir: Path, dataset: Path, *sets: str):
    from hardy.train.config import load_config
    from hardy.train.trainer import train

    cfg = load_config(None, [*BASE, f"data.path={dataset}", *sets])
    return train(cfg, run_dir)


def rel_close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))
