"""Peak memory as the trainer reports it: CPU = peak RSS minus RSS after imports; GPU = max allocated."""
from __future__ import annotations

import resource

import psutil
import torch


class MemoryMeter:
    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = psutil.Process().memory_info().rss  # after imports, before the model exists
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        return max(0, peak - self.baseline)
