"""A small built-in matmul probe: the peak FLOP/s that MFU is measured against.

Measured at the current thread count, for the dtype the run computes in, once per machine: the
result is kept in HARDY_CACHE/matmul, so a restarted or resumed run does not spend seconds measuring
again before its first step, and runs on one machine share one MFU basis. `hardy probe` (the planner)
extends this to a full hardware profile.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import time

import torch

from hardy.devices import cpu_flags, cpuinfo_fields
from hardy.fsio import cache_dir, write_json_atomic


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


def _machine_key(dtype: torch.dtype, device: torch.device) -> str:
    """What the measurement depends on: the device model (CPU: model, flags and thread count), the
    dtype and torch's version."""
    if device.type == "cuda":
        what = [torch.cuda.get_device_name(device)]
    else:
        fields = cpuinfo_fields()
        what = [(fields.get("model name") or [""])[0], " ".join(sorted(cpu_flags(fields))), str(torch.get_num_threads())]
    return hashlib.sha256("|".join([*what, str(dtype), torch.__version__]).encode()).hexdigest()[:16]


def cached_matmul_flops(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[float, str | None]:
    """(FLOP/s, the date it was measured, or None where it was measured now): `measure_matmul_flops`
    once per machine, dtype and thread count, kept in HARDY_CACHE/matmul (delete it to measure again)."""
    device = torch.device(device)
    root = cache_dir("matmul")
    path = root / f"{_machine_key(dtype, device)}.json"
    try:
        kept = json.loads(path.read_text())
        return float(kept["flops"]), str(kept["measured"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: measure (and replace it)
        pass
    flops = measure_matmul_flops(dtype, device)
    try:
        root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"flops": flops, "measured": datetime.date.today().isoformat(),
                                 "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads()},
                          durable=False)
    except OSError:  # a read-only cache costs a measurement per run, nothing more
        pass
    return flops, None
