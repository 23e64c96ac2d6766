"""Hang watchdog: if no step completes within the timeout, dump every thread's stack and exit.

Exiting non-zero (rather than waiting) hands the problem to the launcher, which restarts the
group from the last checkpoint — a stalled collective or a wedged device never recovers alone.
"""
from __future__ import annotations

import faulthandler
import json
import os
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 124


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, timeout_s: float, startup_grace_s: float = 0.0):
        self.run_dir, self.rank, self.timeout = Path(run_dir), rank, timeout_s
        self._last = time.monotonic() + startup_grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hardy-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.timeout > 0 and not self._thread.is_alive():
            self._thread.start()
        return self

    def beat(self, timeout_s: float | None = None) -> None:
        """Progress was made; optionally switch to another timeout from here on."""
        if timeout_s is not None:
            self.timeout = timeout_s
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            stalled = time.monotonic() - self._last
            if self.timeout > 0 and stalled > self.timeout:
                self._dump(stalled)
                os._exit(HANG_EXIT_CODE)

    def _dump(self, stalled: float) -> None:
        stacks = self.run_dir / "stacks"
        stacks.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = stacks / f"hang-{stamp}-rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(f"hardy watchdog: no step completed for {stalled:.1f} s (timeout {self.timeout} s; "
                    f"start-up, including process-group rendezvous, counts too); "
                    f"stacks of every thread of rank {self.rank}, pid {os.getpid()}:\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.flush()
            os.fsync(f.fileno())
        event = {"schema": 1, "event": "hang", "time": time.time(), "rank": self.rank, "stalled_s": stalled,
                 "detect_s": stalled, "stacks": str(path)}
        with open(self.run_dir / f"hang_rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"hardy: error: step stalled for {stalled:.0f} s; stacks written to {path}; exiting for a restart",
              flush=True)
