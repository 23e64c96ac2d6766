"""A small built-in matmul probe: the peak FLOP/s that MFU is measured against.

Measured at the current thread count, for the dtype the run computes in; `hardy probe`
(the planner) extends this to a full hardware profile.
"""
from __future__ import annotations

import time

import torch

from hardy.devices import cpu_flags


def measure_matmul_flops(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                         size: int | None = None, min_time: float = 0.3) -> float:
    device = torch.device(device)
    if size is None:
        # Size to the hardware: without native bf16/fp16 a CPU matmul in those types is ~100x slower.
        size = 4096 if device.type == "cuda" else (2048 if dtype == torch.float32 else 256)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up
    best, elapsed, reps = 0.0, 0.0, 0
    while elapsed < min_time or reps < 3:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        elapsed += dt
        reps += 1
        best = max(best, 2 * size ** 3 / dt)
    return best


def has_fast_bf16(device: torch.device) -> bool:
    """False on CPUs without AVX512-BF16 / AMX (bf16 matmul there is ~100x slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
