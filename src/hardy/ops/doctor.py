"""`hardy doctor`'s checks: what a training job needs from the machines it is about to run on.

Every rank runs the local checks on its own device and directory; the results travel to rank 0 as
JSON in a byte tensor (no pickles), which prints one table. A check is pass, warn or fail (or n/a
where it does not apply); any fail makes the command exit non-zero.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

import hardy
from hardy.ops.matmul_probe import has_fast_bf16
from hardy.ops.telemetry import Thresholds, device_sensors, take_sample

PASS, WARN, FAIL, NA = "pass", "warn", "fail", "n/a"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    rank: int = 0


def check_devices(device: torch.device, rank: int, sample: dict) -> Check:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        ecc = sample.get("ecc_uncorrected")  # None where the GPU has no ECC
        return Check("device", FAIL if ecc else PASS, f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
                     + (f"; uncorrected ECC errors: {ecc}" if ecc else ""), rank)
    vm = psutil.virtual_memory()
    status = WARN if vm.available < 2 * 2**30 else PASS
    return Check("device", status, f"CPU, {os.cpu_count()} logical cores, {vm.available / 2**30:.1f} of "
                                   f"{vm.total / 2**30:.1f} GiB memory available", rank)


def check_thermal(sample: dict, rank: int, limits: Thresholds = Thresholds()) -> Check:
    notes, status = [], PASS
    if sample.get("throttle"):
        notes.append("clocks held down: " + ", ".join(sample["throttle"]))
        status = WARN
    for key, limit, label in (("gpu_temp_c", limits.gpu_temp_c, "GPU"), ("cpu_temp_c", limits.cpu_temp_c, "CPU")):
        if sample.get(key) is not None:
            notes.append(f"{label} {sample[key]:.0f} C")
            if sample[key] >= limit:
                status = WARN
    if sample.get("cpu_freq_mhz"):
        notes.append(f"CPU {sample['cpu_freq_mhz'] / 1000:.2f} GHz")
    if sample.get("sm_clock_mhz") is not None:
        notes.append(f"SM {sample['sm_clock_mhz']} of {sample.get('sm_clock_max_mhz')} MHz")
    absent = [k for k in ("cpu_temp_c", "gpu_temp_c") if k in sample.get("absent", [])]
    if absent:
        notes.append("no sensor: " + ", ".join(absent))
    return Check("clocks and temperature", status, "; ".join(notes), rank)


def check_precision(device: torch.device, dtype: str, rank: int) -> Check:
    fast = has_fast_bf16(device)
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        status = FAIL if dtype == "bf16" and not bf16 else PASS
        return Check("bf16/fp16", status, f"bf16 {'supported' if bf16 else 'NOT supported'}, fp16 supported; "
                                          f"run uses {dtype}", rank)
    status = WARN if dtype != "fp32" and not fast else PASS
    return Check("bf16/fp16", status, ("native bf16 matmul (AVX512-BF16/AMX)" if fast else
                                       "no native bf16/fp16 matmul on this CPU: fp32 is the fast choice")
                 + f"; run uses {dtype}", rank)


def check_directory(run_dir: Path, rank: int, needed_bytes: float, probe_bytes: int) -> list[Check]:
    """Writable (a file written, fsynced, renamed and removed), free space against the job's
    checkpoints, and the write bandwidth a checkpoint will see."""
    mib = max(1, probe_bytes >> 20)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".doctor-{rank}-{os.getpid()}.tmp"
        block = os.urandom(1 << 20)
        t0 = time.perf_counter()
        with open(tmp, "wb") as f:
            for _ in range(mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
        final = tmp.with_suffix(".done")
        os.replace(tmp, final)
        final.unlink()
    except OSError as e:
        return [Check("checkpoint directory", FAIL, f"{run_dir} is not writable: {e.strerror or e}", rank)]
    free = shutil.disk_usage(run_dir).free
    checks = [Check("checkpoint directory", PASS, f"{run_dir} writable", rank)]
    if free < needed_bytes:
        checks.append(Check("free space", FAIL, f"{free / 2**30:.2f} GiB free in {run_dir}, the job's checkpoints "
                                                f"need {needed_bytes / 2**30:.2f} GiB", rank))
    else:
        checks.append(Check("free space", WARN if free < 2 * needed_bytes else PASS,
                            f"{free / 2**30:.1f} GiB free, checkpoints need {needed_bytes / 2**30:.2f} GiB", rank))
    rate = mib * 2**20 / max(seconds, 1e-9)
    checks.append(Check("write bandwidth", WARN if rate < 50e6 else PASS,
                        f"{rate / 1e6:,.0f} MB/s (fsynced); a checkpoint of {needed_bytes / 1e9:.2f} GB in "
                        f"~{needed_bytes / rate:.1f} s", rank))
    return checks


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "hardy": hardy.__version__}
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def gather_json(obj, device: torch.device) -> list:
    """Every rank's `obj` (JSON-able) on every rank: JSON bytes in a padded uint8 tensor, no pickle."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    rows = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(rows, padded)
    return [json.loads(bytes(row[:int(s.item())].cpu().tolist()).decode()) for row, s in zip(rows, sizes)]


def measure_allreduce(device: torch.device, nbytes: int, repeats: int = 5) -> float | None:
    """Median seconds of an all-reduce of `nbytes` across the world; None for one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first one sets up the connections
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_collective(seconds: float | None, nbytes: int, world: int, expected_s: float | None, link: str) -> Check:
    if seconds is None:
        return Check("collective", NA, "one process: nothing to test across ranks")
    bus = 2 * (world - 1) / world * nbytes / seconds
    detail = f"all-reduce of {nbytes / 2**20:.0f} MiB over {world} ranks: {seconds * 1e3:.1f} ms, bus {bus / 1e9:.2f} GB/s"
    if expected_s is None:
        return Check("collective", PASS, detail + " (no planner expectation: give --hardware NAME or probe:FILE)")
    ratio = expected_s / seconds
    status = PASS if ratio >= 0.5 else (WARN if ratio >= 0.2 else FAIL)
    return Check("collective", status, detail + f"; the planner expects {expected_s * 1e3:.1f} ms on {link} "
                                                f"({100 * ratio:.0f}% of it achieved)")


def check_shared_filesystem(run_dir: Path, rank: int, world: int, device: torch.device) -> Check | None:
    """Each rank leaves its host name in the run directory; rank 0 reads them all back."""
    marks = run_dir / ".doctor-hosts"
    try:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / f"rank{rank}").write_text(socket.gethostname())
        written = True
    except OSError:
        written = False  # the directory check above has said why
    hosts = gather_json([socket.gethostname(), written], device)  # every rank takes part, whatever happened
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return None
    if not all(ok for _, ok in hosts):
        return Check("shared filesystem", NA, f"not tested: {run_dir} is not writable")
    hosts = [name for name, _ in hosts]
    seen = {p.name for p in marks.iterdir()}
    missing = [r for r in range(world) if f"rank{r}" not in seen]
    shutil.rmtree(marks, ignore_errors=True)
    nodes = len(set(hosts))
    if missing:
        return Check("shared filesystem", FAIL, f"{run_dir} is not shared by all nodes: rank 0 cannot see the files "
                                                f"of rank(s) {', '.join(map(str, missing))}; multi-node checkpoints "
                                                "need a directory every node sees (NFS, Lustre, ...)")
    return Check("shared filesystem", PASS, f"{run_dir} is seen by all {nodes} nodes" if nodes > 1 else
                 "one node: sharing is not needed (multi-node checkpoints need a directory every node sees)")


def local_checks(run_dir: Path, device: torch.device, rank: int, dtype: str, needed_bytes: float,
                 probe_bytes: int = 64 << 20) -> list[Check]:
    gpu = device_sensors(device)
    sample = take_sample(run_dir if run_dir.exists() else Path(run_dir).anchor or "/", gpu)
    return [check_devices(device, rank, sample), check_thermal(sample, rank), check_precision(device, dtype, rank),
            *check_directory(run_dir, rank, needed_bytes, probe_bytes)]


def as_dicts(checks: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks]
