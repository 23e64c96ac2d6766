"""Preemption: SIGTERM or SIGUSR1 asks a run to checkpoint at the next step boundary and exit 0.

Schedulers warn before they take nodes back (Slurm's `--signal=USR1@120`, Kubernetes' SIGTERM and
grace period, spot instances' notices). The handler only records the request; the training loop
carries it in the step's one all-reduce, so every rank stops after the same step, saves one
checkpoint, and exits 0. RUN_DIR/preempted.json says where it stopped (a launcher or batch script
reads it to decide whether to requeue); a run that reaches its last step removes it.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

from hardy.fsio import write_json_atomic
from hardy.ops.launch import PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """The first stop signal this process received since `install()` (None: none)."""

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict = {}

    def install(self, signals=None) -> "StopRequest":
        """`signals`: those that ask for a stop (default STOP_SIGNALS); the others keep their handlers."""
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for sig in STOP_SIGNALS if signals is None else signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name

    def restore(self, ignore_late: bool = False) -> None:
        """`ignore_late`: SIGUSR1 is ignored from now on rather than handled as before `install()` (a
        launched worker's teardown: a stop its peers already carried out, reaching it late, must not kill
        it, which its agent would take for a failure and restart). SIGTERM is restored even so: it is how
        an agent ends a worker whose peers failed."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore_late and sig == signal.SIGUSR1 else handler)
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None


def record_preemption(run_dir: Path, step: int, checkpoint: str | None, reason: str) -> None:
    write_json_atomic(Path(run_dir) / PREEMPTED, {"step": step, "checkpoint": checkpoint, "signal": reason,
                                                  "time": time.time()})


def preempted_since(run_dir: Path, since: float) -> dict | None:
    """The stop record a run wrote after `since` (a time.time()), if it stopped on a signal with a
    checkpoint; None otherwise."""
    record = read_preemption(run_dir)
    if record is None or not record.get("checkpoint") or record.get("time", 0) < since:
        return None
    return record


def read_preemption(run_dir: Path) -> dict | None:
    """RUN_DIR/preempted.json as written, or None (absent or unreadable)."""
    try:
        record = json.loads((Path(run_dir) / PREEMPTED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def wait_for_preemption(run_dir: Path, step: int, stale: dict | None, timeout_s: float,
                        poll_s: float = 0.1) -> dict | None:
    """The stop record of `step` that another process (on another node, perhaps) writes into the shared
    RUN_DIR, waited for up to `timeout_s`; None if none came. `stale`: the record there before this run
    (a stop at the same step of an earlier run that went back to an older checkpoint is not this one).
    Times are not compared: the writer's clock may be another node's."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_preemption(run_dir)
        if record is not None and record != stale and record.get("step") == step and record.get("checkpoint"):
            return record
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def clear_preemption(run_dir: Path) -> None:
    (Path(run_dir) / PREEMPTED).unlink(missing_ok=True)


def report_stop(name: str, run_dir: Path, started: float) -> int:
    """A launcher stopped by signal `name`: 0 and where it stopped if the run checkpointed after
    `started` (a preemption done right), 1 and why not otherwise."""
    record = preempted_since(run_dir, started)
    if record is None:
        print(f"hardy: error: stopped by {name} before the run could checkpoint", file=sys.stderr)
        return 1
    print(f"hardy: {name}: stopped after step {record['step']} with checkpoint {record['checkpoint']}; "
          "the same command resumes the run")
    return 0
