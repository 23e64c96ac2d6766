"""Failure-aware goodput of a training job at scale, by simulation: checkpoint-restart against per-step
fault tolerance (live recovery), with and without warm spare groups.

A job of `gpus` GPUs in replica groups of `group_gpus` runs for `days`. Interruptions arrive as a
Poisson process at Llama 3's rate (419 in 54 days on 16,384 GPUs, 78% hardware: arXiv 2407.21783),
each striking one replica group. Goodput is the useful work done over what the whole fleet could
have done in the same wall time.

- restart: any interruption stops the job; it restarts (`restart_s`: detection, rescheduling,
  rendezvous, loading) from the last checkpoint, taken at the Young/Daly interval for the job's MTBF
  with a stall of `checkpoint_stall_s` each; the work since it is lost.
- live: the survivors drop the dead group from the quorum (`survivor_stall_s`, all groups) and go
  on; the dead group restarts and heals from a live peer (`group_restart_s` + `heal_s`) — after a
  hardware fault only once its node is replaced (`node_replace_s`). Checkpoints are still written
  (whole-cluster failures, preemption), every `live_checkpoint_s`.
- live+spares: as live, but a warm spare group (started, imported, model built) takes the dead
  group's place in `spare_join_s`; the replaced group, once recovered, becomes a spare.
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import asdict, dataclass

from hardy.errors import HardyError
from hardy.fault.policy import DEFAULT_DEVICE_MTBF_HOURS, daly_interval

STRATEGIES = ("restart", "live", "live+spares")
LLAMA3_EFFECTIVE_TRAINING_TIME = 0.90  # "higher than 90% effective training time" at 16K GPUs (Llama 3 paper)


@dataclass(frozen=True)
class Fleet:
    gpus: int
    group_gpus: int = 128  # a replica group: one model-parallel copy (Llama 3 405B: TP 8 x PP 16)
    days: float = 54.0
    device_mtbf_hours: float = DEFAULT_DEVICE_MTBF_HOURS  # Llama 3: 419 interruptions, 54 days, 16,384 GPUs
    hardware_share: float = 0.78  # Llama 3: 78% of the interruptions were confirmed or suspected hardware

    @property
    def groups(self) -> int:
        return self.gpus // self.group_gpus

    @property
    def job_mtbf_s(self) -> float:
        return self.device_mtbf_hours * 3600 / self.gpus

    def check(self) -> None:
        if self.gpus < 1 or self.group_gpus < 1 or self.gpus % self.group_gpus:
            raise HardyError(f"--gpus {self.gpus} must be a positive multiple of --group-gpus {self.group_gpus}")
        if self.groups < 2:
            raise HardyError(f"{self.gpus} GPUs in groups of {self.group_gpus} is one replica group: live recovery "
                             "needs at least two")
        if not (self.days > 0 and self.device_mtbf_hours > 0 and 0 <= self.hardware_share <= 1):
            raise HardyError("--days and --device-mtbf-hours must be > 0, --hardware-share within [0, 1]")


@dataclass(frozen=True)
class Recovery:
    """Seconds each recovery takes; the defaults and where they come from are in docs/planner.md."""
    restart_s: float = 300.0  # whole-job restart at scale: the planner's default; restart ~ Llama 3's 90% at 16K
    checkpoint_stall_s: float = 30.0  # training stopped per checkpoint (restart mode)
    node_replace_s: float = 1800.0  # a faulty node swapped for one from the cluster's pool (an assumption)
    survivor_stall_s: float = 0.3  # hardy's live recovery here (bench/live_bench.py): the survivors' stall
    group_restart_s: float = 4.6  # torchft here: a replacement process to its first quorum (issue 39)
    heal_s: float = 0.2  # torchft here: state fetched from a live peer (issue 39)
    spare_join_s: float = 0.4  # hardy here: a warm spare's first committed step after the kill (live_bench.py)
    spares: int = 2  # warm spare groups (live+spares)
    live_checkpoint_s: float = 3600.0  # live modes still checkpoint, for whole-cluster failures

    def check(self) -> None:
        values = asdict(self)
        bad = [k for k, v in values.items() if v < 0 or (k in ("live_checkpoint_s",) and v <= 0)]
        if bad:
            raise HardyError(f"recovery times must be >= 0 and the live checkpoint interval > 0 (got {bad[0]} = "
                             f"{values[bad[0]]})")


def failures(fleet: Fleet, rng: random.Random) -> list[tuple[float, bool]]:
    """(time in seconds, hardware?) of every interruption within the job's wall time."""
    out, t, end = [], 0.0, fleet.days * 86400
    while True:
        t += rng.expovariate(1 / fleet.job_mtbf_s)
        if t >= end:
            return out
        out.append((t, rng.random() < fleet.hardware_share))


def restart_goodput(fleet: Fleet, rec: Recovery, events: list[tuple[float, bool]]) -> float:
    """Useful work over wall time when every interruption restarts the whole job from its last checkpoint."""
    end = fleet.days * 86400
    interval = daly_interval(rec.checkpoint_stall_s, fleet.job_mtbf_s)
    cycle = interval + rec.checkpoint_stall_s
    useful, start = 0.0, 0.0  # start: when the job last began computing after a recovery
    for t, _ in events + [(end, False)]:
        window = t - start
        if window > 0 and cycle == 0:  # free checkpoints (no stall) commit every moment's work
            useful += window
        elif window > 0:
            done = math.floor(window / cycle)
            useful += done * interval  # committed by checkpoints
            if t == end:  # the job ends here: the work since its last checkpoint counts
                useful += min(window - done * cycle, interval)
        start = t + rec.restart_s  # a fault during a restart starts it again
    return useful / end


def live_goodput(fleet: Fleet, rec: Recovery, events: list[tuple[float, bool]], spares: int) -> float:
    """Useful work over wall time when survivors go on without the dead group while it recovers (or a
    warm spare, when one is free, takes its place)."""
    end, groups = fleet.days * 86400, fleet.groups
    ready: list[float] = [0.0] * spares  # when each spare is (again) available
    heapq.heapify(ready)
    lost = 0.0  # group-seconds of capacity lost
    for t, hardware in events:
        lost += rec.survivor_stall_s * groups
        own = rec.group_restart_s + rec.heal_s + (rec.node_replace_s if hardware else 0.0)
        if ready and ready[0] <= t:  # a warm spare steps in; the failed group recovers into the pool
            heapq.heapreplace(ready, t + own)
            down = rec.spare_join_s
        else:
            down = own
        lost += min(down, end - t)
    checkpoints = rec.checkpoint_stall_s / (rec.live_checkpoint_s + rec.checkpoint_stall_s)
    return max(0.0, (1 - lost / (groups * end)) * (1 - checkpoints))


def simulate(fleet: Fleet, rec: Recovery, strategies=STRATEGIES, trials: int = 20, seed: int = 0) -> dict:
    """Per strategy: goodput's mean, median and 95% interval over `trials` failure histories (the same
    histories for every strategy), and the interruptions per trial."""
    fleet.check()
    rec.check()
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise HardyError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}")
    if trials < 1:
        raise HardyError(f"--trials must be >= 1 (got {trials})")
    runs = {s: [] for s in strategies}
    counts = []
    for trial in range(trials):
        events = failures(fleet, random.Random(f"{seed}:{fleet.gpus}:{trial}"))
        counts.append(len(events))
        for s in strategies:
            if s == "restart":
                runs[s].append(restart_goodput(fleet, rec, events))
            else:
                runs[s].append(live_goodput(fleet, rec, events, rec.spares if s == "live+spares" else 0))
    out = {"gpus": fleet.gpus, "groups": fleet.groups, "days": fleet.days, "job_mtbf_h": fleet.job_mtbf_s / 3600,
           "interruptions": statistics.median(counts), "strategies": {}}
    for s, values in runs.items():
        values = sorted(values)
        lo, hi = values[int(0.025 * (len(values) - 1))], values[math.ceil(0.975 * (len(values) - 1))]
        out["strategies"][s] = {"mean": statistics.fmean(values), "median": statistics.median(values),
                                "low": lo, "high": hi}
    return out
