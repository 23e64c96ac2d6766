"""Step time as the device sees it.

CUDA kernels run asynchronously: a host clock read when the Python loop reaches the end of a step
measures how fast kernels were *queued*, and the step's tail spills into the next one. On CUDA the
step is timed between two events on the current stream, and the end event is waited for once per
step (the step's one synchronization for timing), so the tokens/s and MFU logged are the GPU's.
On the CPU work is synchronous and the host clock is the truth.
"""
from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0 = 0.0
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since start(): the GPU's time between the two events on CUDA."""
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1000.0
        return time.perf_counter() - self._t0
