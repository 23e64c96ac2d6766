"""Built-in fault injection: faults that behave like real ones, fired reproducibly and only once.

Spec: comma-separated `KIND@STEP[@rankR]`, KIND one of kill, kill_in_ckpt, nan, spike, hang,
corrupt_ckpt. Random failures: `random_kill_rate` = probability that a step ends in a SIGKILL,
drawn from `random_seed` and the step number (the same run fails at the same steps every time).

A fault that fired is recorded in RUN_DIR/faults_fired.json (fsynced before it acts), so a
restarted run replaying the same step does not fail again — as with a real, transient fault.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hardy.errors import HardyError

KINDS = ("kill", "kill_in_ckpt", "nan", "spike", "hang", "corrupt_ckpt")
LEDGER = "faults_fired.json"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.step}@rank{self.rank}"


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split("@")
        if len(parts) not in (2, 3) or parts[0] not in KINDS or not parts[1].isdigit():
            raise HardyError(f"invalid config: fault.inject item {item!r}: expected KIND@STEP[@rankR] with KIND in "
                             f"{', '.join(KINDS)}")
        rank = 0
        if len(parts) == 3:
            if not (parts[2].startswith("rank") and parts[2][4:].isdigit()):
                raise HardyError(f"invalid config: fault.inject item {item!r}: the third part must be rankR")
            rank = int(parts[2][4:])
        faults.append(Fault(parts[0], int(parts[1]), rank))
    return faults


class FaultInjector:
    def __init__(self, spec: str, run_dir: Path, rank: int, random_kill_rate: float = 0.0, random_seed: int = 0):
        self.faults = parse_faults(spec)
        self.rank, self.run_dir = rank, Path(run_dir)
        self.random_kill_rate, self.random_seed = random_kill_rate, random_seed

    @property
    def active(self) -> bool:
        return bool(self.faults) or self.random_kill_rate > 0

    def _fired(self) -> set[str]:
        path = self.run_dir / LEDGER
        return set(json.loads(path.read_text())) if path.is_file() else set()

    def _claim(self, key: str) -> bool:
        """Record the fault as fired (durably) and return True, unless it already fired."""
        fired = self._fired()
        if key in fired:
            return False
        fired.add(key)
        path = self.run_dir / LEDGER
        tmp = path.with_name(f".{path.name}.{self.rank}.tmp")
        with open(tmp, "w") as f:
            json.dump(sorted(fired), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True

    def due(self, kind: str, step: int) -> bool:
        for fault in self.faults:
            if fault.kind == kind and fault.rank == self.rank and (
                    fault.step == step or (kind in ("kill_in_ckpt", "corrupt_ckpt") and step >= fault.step)):
                if self._claim(fault.key):
                    return True
        return False

    def random_kill_due(self, step: int) -> bool:
        if self.random_kill_rate <= 0 or self.rank != 0:
            return False
        draw = random.Random(f"{self.random_seed}:{step}").random()
        return draw < self.random_kill_rate and self._claim(f"random_kill@{step}")

    @staticmethod
    def kill() -> None:
        """A hard crash: no cleanup, no flush, like a lost node."""
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def hang() -> None:
        while True:  # a stalled step: only the watchdog gets us out
            time.sleep(3600)


def corrupt_file(directory: Path) -> Path:
    """Damage a checkpoint's largest data file in place (flip bytes in the middle)."""
    files = sorted((f for f in directory.iterdir() if f.suffix == ".distcp"), key=lambda f: f.stat().st_size)
    target = files[-1]
    with open(target, "r+b") as f:
        f.seek(target.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(target.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
        f.flush()
        os.fsync(f.fileno())
    return target
