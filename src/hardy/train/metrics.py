"""Per-step metrics on rank 0: one fixed-format line, and the same dict to every sink.

JSONL schema (version 1, documented in docs/metrics.md): one object per line with "schema" and
"event" ("start", "step", "checkpoint", "checkpoint_complete", "rollback", "end"); step records carry the keys in STEP_KEYS.
"""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from hardy.extras import require as require_extra

SCHEMA_VERSION = 1
STEP_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "step_time_s", "mfu",
             "peak_mem_bytes", "ckpt_stall_s", "ckpt_wait_s", "skipped", "loss_scale")


def format_step(m: dict, total_steps: int) -> str:
    skipped = "  ROLLED BACK (loss spike)" if m.get("spike") else ("  SKIPPED (non-finite)" if m["skipped"] else "")
    mfu = f"{100 * m['mfu']:5.1f}%" if m["mfu"] is not None else "   n/a"
    return (f"step {m['step']:>6}/{total_steps} | loss {m['loss']:8.4f} | gnorm {m['grad_norm']:7.3f} | "
            f"lr {m['lr']:.2e} | {m['tokens_per_s']:>9,.0f} tok/s | mfu {mfu} | "
            f"mem {m['peak_mem_bytes'] / 2**20:8.1f} MiB | ckpt {m['ckpt_stall_s']:5.2f} s{skipped}")


class MetricsLogger:
    """Writes to the console (with a progress bar), metrics.jsonl and optionally TensorBoard."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool, every: int = 1,
                 jsonl: bool = True, tensorboard: bool = False, progress: bool = True):
        self.enabled, self.every, self.total = enabled, every, total_steps
        self.prefix = ""  # before every console line (live recovery: which replica group speaks)
        self.step_lines = True  # the periodic step lines on the console (metrics.jsonl has every step regardless)
        self._jsonl = self._tb = self._bar = None
        self._lock = threading.Lock()  # the telemetry thread logs too
        if not enabled:
            return
        if jsonl:
            self._jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            require_extra("tensorboard", "log.tensorboard = true")
            from torch.utils.tensorboard import SummaryWriter  # optional: the `tensorboard` extra
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if progress and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, leave=False)

    def event(self, name: str, **fields) -> None:
        if self.enabled and self._jsonl:
            line = json.dumps({"schema": SCHEMA_VERSION, "event": name, "time": time.time(), **fields}) + "\n"
            with self._lock:
                self._jsonl.write(line)

    def scalars(self, group: str, values: dict, step: int) -> None:
        """The numeric fields of `values` to TensorBoard as GROUP/KEY (absent sensors are skipped)."""
        if self.enabled and self._tb:
            with self._lock:
                for key, value in values.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "time":
                        self._tb.add_scalar(f"{group}/{key}", value, step)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            if self._bar is not None:
                self._bar.write(self.prefix + text)
            else:
                sys.stdout.write(self.prefix + text + "\n")  # one write: groups share the console
                sys.stdout.flush()

    def step(self, m: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
        self.event("step", **clean)
        self.scalars("train", {k: clean.get(k) for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu",
                                                        "peak_mem_bytes")}, m["step"])
        if self.step_lines and (m["step"] % self.every == 0 or m["step"] == self.total or m["skipped"]):
            self.print(format_step(m, self.total))
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
