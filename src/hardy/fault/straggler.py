"""Straggler detection: one slow rank holds every step of a synchronous job back.

Each rank times its own steps: `compute_s` is the work it did itself and `wait_s` the rest of the
step's wall time (blocked in collectives on slower peers, or on I/O). On CPU the work is the process's
CPU time — a rank blocked in a gloo collective sleeps and spends none — so a fast rank waiting for a
slow one shows its wait as wait, not as compute. On CUDA it is the step's wall time less the time in
the step's closing all-reduce (kernels waiting on NCCL inside backward count as compute there, so the
GPU figure understates the slow rank's lead). Every `every` steps the window's medians are gathered,
with each rank's telemetry (hardy.ops.telemetry), and a rank whose compute exceeds `factor` times the
median of the other ranks' is named. A rank named in `stop_after` windows in a row stops the job.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist

from hardy.errors import HardyError

# the telemetry beside each rank in a straggler report (None where the sensor is absent)
BRIEF = ("cpu_freq_mhz", "load_1m", "cpu_temp_c", "rss_bytes", "swap_used_bytes", "gpu_temp_c", "sm_clock_mhz",
         "power_w")


def brief(sample: dict | None) -> list[float]:
    sample = sample or {}
    return [math.nan if sample.get(k) is None else float(sample[k]) for k in BRIEF]


def find_stragglers(compute: list[float], factor: float) -> list[tuple[int, float]]:
    """(rank, compute ÷ the median of the other ranks') for every rank slower than `factor` times it."""
    slow = []
    for rank, mine in enumerate(compute):
        others = compute[:rank] + compute[rank + 1:]
        typical = statistics.median(others) if others else mine
        if typical > 0 and mine > factor * typical:
            slow.append((rank, mine / typical))
    return slow


def describe_telemetry(values: list[float]) -> str:
    named = dict(zip(BRIEF, values))
    parts = []
    if not math.isnan(named["cpu_freq_mhz"]):
        parts.append(f"cpu {named['cpu_freq_mhz'] / 1000:.2f} GHz")
    if not math.isnan(named["load_1m"]):
        parts.append(f"load {named['load_1m']:.1f}")
    parts.append("cpu temp " + ("n/a" if math.isnan(named["cpu_temp_c"]) else f"{named['cpu_temp_c']:.0f} C"))
    if not math.isnan(named["gpu_temp_c"]):
        parts.append(f"gpu {named['gpu_temp_c']:.0f} C")
    if not math.isnan(named["sm_clock_mhz"]):
        parts.append(f"SM {named['sm_clock_mhz']:.0f} MHz")
    if not math.isnan(named["power_w"]):
        parts.append(f"{named['power_w']:.0f} W")
    if not math.isnan(named["swap_used_bytes"]):
        parts.append(f"swap {named['swap_used_bytes'] / 2**20:,.0f} MiB")
    return ", ".join(parts)


class StragglerMonitor:
    """Step hooks (hardy.train.hooks.StepHooks). `telemetry()` returns this rank's newest sample or
    None; `report(event, fields, line)` is called on every rank (the trainer logs rank 0's)."""

    def __init__(self, every: int, factor: float, stop_after: int, device: torch.device, telemetry, report):
        self.every, self.factor, self.stop_after = every, factor, stop_after
        self.device, self.telemetry, self.report = device, telemetry, report
        self.compute: list[float] = []  # this window's steps
        self.wait: list[float] = []
        self.sync_wait = 0.0  # time in the step's closing all-reduce and read-back (the trainer adds it)
        # CUDA: the GPU's own time from the step's start to its closing all-reduce, by events on the
        # stream; host clocks see only the launches (kernels run asynchronously), never a slow GPU.
        # No end event: the step never reached its all-reduce.
        self._start = self._end = None
        self.window_start, self.window_steps = None, 0
        self.flagged: dict[int, int] = {}  # rank -> windows in a row

    def before_step(self, step: int) -> None:
        if self.window_start is None:
            self.window_start = step
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        self.sync_wait = 0.0
        self._end = None
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def compute_done(self) -> None:
        """Called by the trainer where the step's compute ends and its closing all-reduce begins."""
        if self._start is not None:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()

    def after_step(self, step: int) -> None:
        wall = time.perf_counter() - self._wall0
        if self._end is not None:
            # both events are behind the step's read-back, so reading them waits for nothing
            compute = self._start.elapsed_time(self._end) / 1000
        elif self.device.type == "cuda":  # a step that never reached its all-reduce
            compute = wall - self.sync_wait
        else:  # CPU seconds over torch's threads: a step's work is spread over them
            compute = min(wall, (time.process_time() - self._cpu0) / max(1, torch.get_num_threads()))
        self.compute.append(compute)
        self.wait.append(max(0.0, wall - compute))
        self.window_steps += 1  # the same count on every rank (a rolled-back step never gets here)
        if self.window_steps == self.every:
            self._compare(step)

    def _compare(self, step: int) -> None:
        # medians: one step held up by a page fault or a neighbour's burst is not a slow rank
        mine = torch.tensor([statistics.median(self.compute), statistics.median(self.wait), *brief(self.telemetry())],
                            dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).cpu().tolist()  # every `every` steps: the one read-back of this window
        first = self.window_start
        self.window_start, self.window_steps, self.compute, self.wait = None, 0, [], []
        compute = [row[0] for row in table]
        ranks = [{"rank": r, "compute_s": row[0], "wait_s": row[1],
                  "telemetry": {k: (None if math.isnan(v) else v) for k, v in zip(BRIEF, row[2:])}}
                 for r, row in enumerate(table)]
        slow = find_stragglers(compute, self.factor)
        self.report("rank_times", {"steps": [first, step], "ranks": ranks}, None)
        self.flagged = {rank: self.flagged.get(rank, 0) + 1 for rank, _ in slow}
        for rank, ratio in slow:
            others = statistics.median(compute[:rank] + compute[rank + 1:])
            line = (f"straggler: rank {rank} took {ratio:.1f}x the others' compute over steps {first}-{step} "
                    f"(median {compute[rank]:.3f} s/step against {others:.3f}; waiting {ranks[rank]['wait_s']:.3f} s) "
                    f"— {describe_telemetry(table[rank][2:])}")
            self.report("straggler", {"steps": [first, step], "rank": rank, "ratio": ratio,
                                      "windows_in_a_row": self.flagged[rank], "ranks": ranks}, line)
            if self.stop_after and self.flagged[rank] >= self.stop_after:
                raise HardyError(f"rank {rank} was a straggler ({ratio:.1f}x the others) in {self.flagged[rank]} "
                                 f"windows in a row: stopping (health.straggler_stop_after = {self.stop_after}); "
                                 "drain its node, or restart the job without it")
