"""Built-in fault injection: faults that behave like real ones, fired reproducibly and only once.

Spec: comma-separated `KIND@STEP[@rankR]`, KIND one of kill (after step STEP), kill_mid_step (inside
it, after the forward pass: its peers are mid-step or in the all-reduce), kill_in_ckpt, nan, spike, hang,
corrupt_ckpt, io_error and disk_full (the rank's first checkpoint write from STEP on fails with EIO or
ENOSPC); and `slow@rankR:Fx[@A-B]`, a rank whose every step (or steps A to B) takes F times
its compute, burnt as real work (a throttled or sick device), for straggler detection. Random
failures: `random_kill_rate` = probability that a step ends in a SIGKILL, drawn from `random_seed` and the step number (the same run fails at the same steps every time).

A fault that fired is recorded in RUN_DIR/faults_fired.json (fsynced before it acts), so a
restarted run replaying the same step does not fail again — as with a real, transient fault.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hardy.errors import HardyError

KINDS = ("kill", "kill_mid_step", "kill_in_ckpt", "nan", "spike", "hang", "corrupt_ckpt", "io_error",
         "disk_full")  # and slow
CHECKPOINT_KINDS = ("kill_in_ckpt", "corrupt_ckpt", "io_error", "disk_full")  # at the first save from STEP on
LEDGER = "faults_fired.json"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    factor: float = 1.0  # slow: the step's compute multiplied by this
    until: int | None = None  # slow: the last step it applies to (None: to the end)

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.step}@rank{self.rank}"


def _parse_slow(item: str) -> Fault:
    """slow@rankR:Fx[@A-B]"""
    parts = item.split("@")
    rank_factor = parts[1].split(":") if len(parts) in (2, 3) else []
    steps = parts[2].split("-") if len(parts) == 3 else ["1", ""]
    ok = (len(rank_factor) == 2 and rank_factor[0].startswith("rank") and rank_factor[0][4:].isdigit()
          and rank_factor[1].endswith("x") and len(steps) == 2 and steps[0].isdigit()
          and (steps[1].isdigit() or (steps[1] == "" and len(parts) == 2)))
    try:
        factor = float(rank_factor[1][:-1]) if ok else 0.0
    except ValueError:
        factor = 0.0
    if not ok or not 1.0 < factor <= 100.0 or (steps[1] and int(steps[1]) < int(steps[0])):
        raise HardyError(f"invalid config: fault.inject item {item!r}: expected slow@rankR:Fx or slow@rankR:Fx@A-B "
                         "(F in (1, 100], steps A <= B)")
    return Fault("slow", int(steps[0]), int(rank_factor[0][4:]), factor, int(steps[1]) if steps[1] else None)


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item.startswith("slow@"):
            faults.append(_parse_slow(item))
            continue
        parts = item.split("@")
        if len(parts) not in (2, 3) or parts[0] not in KINDS or not parts[1].isdigit():
            raise HardyError(f"invalid config: fault.inject item {item!r}: expected KIND@STEP[@rankR] with KIND in "
                             f"{', '.join(KINDS)}, or slow@rankR:Fx[@A-B]")
        rank = 0
        if len(parts) == 3:
            if not (parts[2].startswith("rank") and parts[2][4:].isdigit()):
                raise HardyError(f"invalid config: fault.inject item {item!r}: the third part must be rankR")
            rank = int(parts[2][4:])
        faults.append(Fault(parts[0], int(parts[1]), rank))
    return faults


class FaultInjector:
    def __init__(self, spec: str, run_dir: Path, rank: int, random_kill_rate: float = 0.0, random_seed: int = 0,
                 victims: int = 1):
        """`victims`: the ranks a random kill may strike, 0..victims-1 (restart recovery: rank 0, which takes
        the whole job down anyway; live recovery: any process of any group)."""
        self.victims = victims
        self.faults = parse_faults(spec)
        self.rank, self.run_dir = rank, Path(run_dir)
        self.random_kill_rate, self.random_seed = random_kill_rate, random_seed
        self._nan = self._spike = self._kill_mid = False  # this step's faults inside it (before_step decides)
        self._slow = [f for f in self.faults if f.kind == "slow" and f.rank == rank]
        self._cpu0 = 0.0

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
                    fault.step == step or (kind in CHECKPOINT_KINDS and step >= fault.step)):
                if self._claim(fault.key):
                    return True
        return False

    def random_kill_due(self, step: int) -> bool:
        if self.random_kill_rate <= 0:
            return False
        rng = random.Random(f"{self.random_seed}:{step}")
        draw, victim = rng.random(), rng.randrange(self.victims)
        return victim == self.rank and draw < self.random_kill_rate and self._claim(f"random_kill@{step}")

    # The trainer's step hooks (hardy.train.hooks.StepHooks): injection acts around the step, never in it.

    def before_step(self, step: int) -> None:
        if self.due("hang", step):
            self.hang()
        self._nan, self._spike = self.due("nan", step), self.due("spike", step)
        self._kill_mid = self.due("kill_mid_step", step)
        self._cpu0 = time.process_time()

    def loss(self, step: int, loss):
        if self._kill_mid:
            self.kill()
        if self._nan:
            loss = loss * float("nan")
        if self._spike:
            loss = loss * 20.0  # its gradients are 20x too: the update must not be applied
        return loss

    def after_step(self, step: int) -> None:
        for fault in self._slow:
            if fault.step <= step and (fault.until is None or step <= fault.until):
                burn_cpu((fault.factor - 1) * (time.process_time() - self._cpu0))
        if self.due("kill", step) or self.random_kill_due(step):
            self.kill()

    def checkpoint_written(self, step: int) -> None:
        """The checkpoint's files are on disk, its completion marker is not: the worst moment to die, or
        for this rank's write to fail (a failing or full disk, as the checkpoint layer would see it)."""
        if self.due("kill_in_ckpt", step):
            self.kill()
        for kind, code in (("io_error", errno.EIO), ("disk_full", errno.ENOSPC)):
            if self.due(kind, step):
                raise OSError(code, f"{os.strerror(code)} (injected: fault.inject {kind})")

    def checkpoint_saved(self, path: Path, step: int, is_main: bool) -> None:
        if is_main and self.due("corrupt_ckpt", step):
            log.info("fault injection: damaged %s", corrupt_file(path))

    @staticmethod
    def kill() -> None:
        """A hard crash: no cleanup, no flush, like a lost node."""
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def hang() -> None:
        while True:  # a stalled step: only the watchdog gets us out
            time.sleep(3600)


def burn_cpu(cpu_seconds: float) -> None:
    """Real work for this long in process CPU time, on torch's threads like a training step's, so a
    slowed rank is slower by wall clock and by CPU time alike (as a throttled CPU is)."""
    a = torch.ones(256, 256)
    end = time.process_time() + cpu_seconds
    while time.process_time() < end:
        a = (a @ a).clamp_(-1, 1)


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
