"""Step time as the device sees it, without a synchronization of its own.

CUDA kernels run asynchronously: a host clock read when the Python loop reaches the end of a step
measures how fast kernels were *queued*, and the step's tail spills into the next one. On CUDA each
step records an event just before its one read-back (`mark`); the read-back waits for the stream, so
by `stop` the event has happened and reading it waits for nothing. A step's time runs from the
previous step's mark to its own — the optimizer's tail of one step lies in the next one's window, so
over consecutive steps every kernel is counted once — or from its own start after a `pause` (a save or
a rollback between steps is not a step's time). On the CPU work is synchronous and the host clock,
start to stop, is the truth.
"""
from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        self._continuous = False  # the previous step's mark begins this step's window
        if self.cuda:
            self._start, self._mark, self._previous = (torch.cuda.Event(enable_timing=True) for _ in range(3))

    def start(self) -> None:
        if self.cuda and not self._continuous:
            self._start.record()
        self._t0 = time.perf_counter()

    def mark(self) -> None:
        """Where the step's work has been queued: just before its read-back from the device."""
        if self.cuda:
            self._mark.record()

    def stop(self) -> float:
        """Seconds of this step, after its read-back: the GPU's time between two events on CUDA."""
        if not self.cuda:
            return time.perf_counter() - self._t0
        begin = self._previous if self._continuous else self._start
        seconds = begin.elapsed_time(self._mark) / 1000.0
        self._previous, self._mark = self._mark, self._previous
        self._continuous = True
        return seconds

    def pause(self) -> None:
        """Work outside the steps follows: the next step is timed from its own start."""
        self._continuous = False
