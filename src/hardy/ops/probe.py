"""`hardy probe`: measure this machine and describe it as a versioned JSON profile (docs/probe.md).

Every measurement is sized to the hardware so the whole probe stays short: a matmul dtype that turns
out slow (bf16 on a CPU without native bf16 runs ~100x slower than fp32) is never tried at a size
that would take seconds. The profile feeds the planner through `--hardware probe:FILE`.
"""
from __future__ import annotations

import datetime
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil
import torch
import torch.distributed as dist
from tqdm import tqdm

from hardy.devices import DTYPES, cpu_flags, cpuinfo_fields
from hardy.errors import HardyError
from hardy.ops.kernel_probe import (
    measure_attention,
    measure_elementwise,
    measure_gemv,
    measure_layer_gemms,
    measure_training_gemms,
    sync,
)

SCHEMA = "hardy.probe/1"
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma", "sve", "bf16", "i8mm")
KiB, MiB = 1 << 10, 1 << 20


# ---------------------------------------------------------------- system description

def cpu_info() -> dict:
    fields = cpuinfo_fields()
    model = (fields.get("model name") or [platform.processor() or platform.machine()])[0]
    flags = cpu_flags(fields)
    sockets = len(set(fields["physical id"])) if "physical id" in fields else None
    mem = psutil.virtual_memory()
    isa_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags) or ("bf16" in flags and platform.machine() == "aarch64")
    return {"model": model, "physical_cores": psutil.cpu_count(logical=False) or os.cpu_count(),
            "logical_cpus": psutil.cpu_count(logical=True) or os.cpu_count(), "sockets": sockets,
            "flags": {f: f in flags for f in ISA_FLAGS}, "fast_bf16_isa": isa_bf16,
            "memory_total_bytes": int(mem.total), "memory_available_bytes": int(mem.available)}


def gpu_info() -> dict | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(), "memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}", "bf16_supported": torch.cuda.is_bf16_supported()}


# ---------------------------------------------------------------- matmul

def measure_matmul(dtype: torch.dtype, device: torch.device, sizes: list[int], min_time: float,
                   max_single: float) -> dict:
    """FLOP/s of square matmuls, growing the size only while the next one (~8x the work) is predicted
    to take under `max_single` seconds per multiply."""
    rows, stopped = [], "largest size in the list"
    for size in sizes:
        multiply = _square_multiply(dtype, device, size)
        sync(device)
        t0 = time.perf_counter()
        multiply()  # warm-up: kernel selection / JIT and first-touch of the output
        sync(device)
        first = time.perf_counter() - t0
        # On a GPU one multiply is microseconds: time a batch so the timer and launch noise vanish.
        inner = max(1, min(200, int(0.005 / max(first, 1e-7))))
        best, spent, reps = float("inf"), 0.0, 0
        while reps < 2 or (spent < min_time and reps < 100):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                multiply()
            sync(device)
            dt = time.perf_counter() - t0
            best, spent, reps = min(best, dt / inner), spent + dt, reps + 1
        rows.append({"size": size, "seconds": best, "flops": 2 * size ** 3 / best, "multiplies": reps * inner})
        del multiply
        if best * 8 > max_single and size != sizes[-1]:
            stopped = f"size {size * 2} would take ~{best * 8:.2f} s per multiply (limit {max_single} s)"
            break
    return {"best_flops": max(r["flops"] for r in rows), "sizes": rows, "stopped": stopped}


# fp8 training's GEMM (torchao's float8 linears with tensorwise scaling): e4m3 operands, the second
# column-major as the kernel wants it, fp32 scales, a bf16 result
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_RECIPE = "tensorwise: e4m3 x e4m3 (column-major B) -> bf16, torch._scaled_mm"


def _square_multiply(dtype: torch.dtype, device: torch.device, size: int):
    """One size x size multiply in `dtype`, ready to call."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    if dtype is not FP8:
        return lambda: a @ b
    one = torch.ones((), device=device)
    bt = b.t()
    return lambda: torch._scaled_mm(a, bt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def fp8_matmul_unsupported(device: torch.device) -> str | None:
    """Why this device cannot run an fp8 GEMM, or None when it can."""
    if FP8 is None or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 matmul"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 tensor cores need compute capability 8.9 (Ada, Hopper) or newer"
    try:
        _square_multiply(FP8, device, 16)()
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._scaled_mm fails here: {str(e).splitlines()[0][:120]}"
    return None


def _matmul_sizes(device: torch.device, quick: bool) -> tuple[list[int], float, float]:
    """(sizes to try, minimum seconds per size, the longest single multiply to allow)."""
    if device.type == "cuda":
        sizes = [1024, 2048, 4096] + ([] if quick else [8192])
    else:
        sizes = [128, 256, 512, 1024] + ([] if quick else [2048])
    return (sizes, *((0.1, 0.25) if quick else (0.3, 0.5)))


def _matmul_all(device: torch.device, quick: bool) -> dict:
    return {name: measure_matmul(dt, device, *_matmul_sizes(device, quick)) for name, dt in DTYPES.items()}


def measure_fp8_matmul(device: torch.device, quick: bool) -> dict:
    """fp8 GEMM FLOP/s (`FP8_RECIPE`) by size, or why it was not measured."""
    reason = fp8_matmul_unsupported(device)
    if reason is not None:
        return {"skipped": reason, "recipe": FP8_RECIPE}
    return {**measure_matmul(FP8, device, *_matmul_sizes(device, quick)), "recipe": FP8_RECIPE}


# ---------------------------------------------------------------- per-operator overhead

def measure_op_overhead(device: torch.device, chain: int = 200, repeats: int = 10) -> dict:
    """Host time per eager operator on tiny tensors, so only the overhead is timed: Python + ATen
    dispatch on a CPU, launch throughput on a GPU (launches are asynchronous: one sync per chain).
    `op_overhead_s` follows the planner's accounting of training ops: a chain of `chain` multiplies
    with autograd, forward and backward, divided by 3 x chain (one forward + two backward ops each)."""
    x = torch.ones(4, device=device, requires_grad=True)
    w = torch.ones(4, device=device, requires_grad=True)
    train = plain = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        y = x
        for _ in range(chain):
            y = y * w
        y.sum().backward()
        sync(device)
        train = min(train, (time.perf_counter() - t0) / (3 * chain))
        with torch.no_grad():
            t0 = time.perf_counter()
            for _ in range(chain):
                torch.mul(x, w)
            sync(device)
            plain = min(plain, (time.perf_counter() - t0) / chain)
    return {"device": device.type, "op": "multiply of 4 elements", "chain": chain, "repeats": repeats,
            "op_overhead_s": train, "no_grad_op_s": plain}


# ---------------------------------------------------------------- memory bandwidth

def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """Stream-style copy of one large buffer into another: read + write = 2 x nbytes per copy."""
    if device.type == "cpu":
        # keep well inside free RAM (src + dst + headroom)
        nbytes = max(16 * MiB, min(nbytes, psutil.virtual_memory().available // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.fill_(0)  # touch every page so first-touch faults are not timed
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return {"device": device.type, "buffer_bytes": nbytes, "bytes_per_copy": 2 * nbytes, "repeats": repeats,
            "best_seconds": best, "bandwidth": 2 * nbytes / best}


# ---------------------------------------------------------------- disk

def measure_disk(directory: Path, nbytes: int) -> dict:
    """Write with fsync, drop the file from the page cache, read it back; the file is removed after."""
    path = directory / f".hardy-probe-{os.getpid()}.tmp"
    chunk = os.urandom(4 * MiB)  # incompressible, so a compressing filesystem cannot cheat
    cache_dropped = False
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = 0
            while written < nbytes:
                written += os.write(fd, chunk[: min(len(chunk), nbytes - written)])
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                try:  # the pages are clean after fsync, so DONTNEED really evicts them
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    cache_dropped = True
                except OSError:
                    pass
            buf = bytearray(4 * MiB)
            view = memoryview(buf)
            t0 = time.perf_counter()
            read = 0
            while (n := os.readv(fd, [view])) > 0:
                read += n
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    except OSError as e:
        raise HardyError(f"disk test in {directory}: {e.strerror or e}") from None
    finally:
        path.unlink(missing_ok=True)
    note = "" if cache_dropped else "page cache could not be dropped: the read figure may come from RAM"
    return {"directory": str(directory.resolve()), "file_bytes": nbytes, "write_seconds": write_s,
            "write_bandwidth": nbytes / write_s, "read_seconds": read_s, "read_bandwidth": read / read_s,
            "read_cache_dropped": cache_dropped, "note": note}


# ---------------------------------------------------------------- all-reduce between processes

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, world: int, port: int, backend: str, sizes: list[int], target: float) -> None:
    """One rank of the all-reduce test; rank 0 prints the per-size results as one JSON line."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=dt.timedelta(seconds=30))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(x)  # warm-up: connections and buffers
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(x)
        sync(device)
        one = (time.perf_counter() - t0) / 5
        # Both ranks must run the same loops: rank 0 decides the count and broadcasts it.
        count = torch.tensor([max(2, min(1000, int(target / 3 / max(one, 1e-7))))], dtype=torch.int64, device=device)
        dist.broadcast(count, 0)
        n = int(count.item())
        best = float("inf")
        for _ in range(3):  # best of three segments: a shared machine's hiccups hit some, not all
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            sync(device)
            took = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
            best = min(best, float(took.item()))
        rows.append({"bytes": nbytes, "seconds": best, "iterations": 3 * n})
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(rows), flush=True)


def allreduce_backend(n_gpu: int, world: int) -> tuple[str, str]:
    """(backend, note) for the all-reduce test's `world` processes: NCCL with one GPU each, else gloo
    between CPU processes (rank r uses cuda:r, so fewer GPUs than ranks would ask for one that is absent)."""
    if n_gpu >= world:
        return "nccl", ""
    if n_gpu:
        return "gloo", f"{n_gpu} GPU(s) for {world} ranks: NCCL needs one each, so this is gloo between CPU processes"
    return "gloo", ""


def measure_allreduce(quick: bool, timeout: float | None = None) -> dict:
    """Two local processes, one thread each; gloo on CPU, NCCL when two GPUs exist.
    Returns {"error": ...} rather than raising: the rest of the profile is still worth writing."""
    world = 2
    backend, note = allreduce_backend(torch.cuda.device_count() if torch.cuda.is_available() else 0, world)
    sizes = ([4 * KiB, 256 * KiB, 4 * MiB, 64 * MiB] if quick else
             [4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB])
    target = 0.05 if quick else 0.2
    timeout = timeout or (90.0 if quick else 180.0)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[2])  # the directory holding the hardy package
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # stay on loopback whatever the hostname resolves to
    port = _free_port()
    procs = []
    try:
        for rank in range(world):
            args = json.dumps([rank, world, port, backend, sizes, target])
            procs.append(subprocess.Popen([sys.executable, "-m", "hardy.ops.probe", "--allreduce-worker", args],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        deadline = time.monotonic() + timeout
        outs = []
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        return {"backend": backend, "error": f"all-reduce test did not finish within {timeout:.0f} s"}
    finally:
        for p in procs:  # never leave a rank behind, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        err = next((e for (_, e), p in zip(outs, procs) if p.returncode != 0), "")
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {"backend": backend, "error": f"all-reduce worker failed: {last}"}
    try:
        rows = json.loads(outs[0][0].strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"backend": backend, "error": "all-reduce worker printed no result"}
    factor = 2 * (world - 1) / world  # nccl-tests "bus bandwidth" convention
    for r in rows:
        r["algorithm_bandwidth"] = r["bytes"] / r["seconds"]
        r["bus_bandwidth"] = factor * r["bytes"] / r["seconds"]
    return {"backend": backend, "processes": world, "threads_per_process": 1, "note": note, "sizes": rows,
            "latency_s": rows[0]["seconds"], "bus_bandwidth": rows[-1]["bus_bandwidth"]}


# ---------------------------------------------------------------- the probe

def run_probe(directory: Path, quick: bool = False, progress: bool = True,
              measure_quant: Callable[[torch.device, bool], dict | None] | None = None,
              measure_runtime: Callable[[Path], dict] | None = None) -> dict:
    """The machine's profile. The two steps that run higher layers (hardy's int4 kernel:
    compress.kernel_rate; a real training run against the planner: plan.runtime_probe) are handed in
    by the caller, so ops/ imports neither; without them their sections are left out."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HardyError(f"--dir {directory}: not a directory")
    start = time.perf_counter()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    profile: dict = {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds").replace("+00:00", "Z"), "quick": quick, "hostname": socket.gethostname(),
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "threads": torch.get_num_threads(), "device": device.type}

    def system():
        profile["cpu"], profile["gpu"] = cpu_info(), gpu_info()

    def matmul():
        dtypes = _matmul_all(device, quick)
        fp32 = dtypes["fp32"]["best_flops"]
        if device.type == "cuda":
            fast_bf16 = fast_fp16 = torch.cuda.is_bf16_supported()
        else:  # measured, not guessed from flags: a torch build may not use the ISA at all
            fast_bf16 = dtypes["bf16"]["best_flops"] >= 0.5 * fp32
            fast_fp16 = dtypes["fp16"]["best_flops"] >= 0.5 * fp32
        fp8 = measure_fp8_matmul(device, quick)
        # fp8 counts as fast where it beats fp32 by the margin bf16 must (a CPU's fp8 GEMM is emulated)
        fast_fp8 = "best_flops" in fp8 and (device.type == "cuda" or fp8["best_flops"] >= 0.5 * fp32)
        profile["matmul"] = {"device": device.type, "threads": torch.get_num_threads(), "dtypes": dtypes,
                             "fast_bf16": fast_bf16, "fast_fp16": fast_fp16, "fp8": fp8, "fast_fp8": fast_fp8}

    def training_shapes():
        best = profile["matmul"]["dtypes"]["fp32"]["best_flops"]
        profile["training_gemm"] = measure_training_gemms(device, best, quick)
        # a real layer's GEMMs in the dtype this device trains in: fp32 on a CPU, bf16 on a GPU
        trains_in = "bf16" if device.type == "cuda" else "fp32"
        profile["layer_gemm"] = measure_layer_gemms(device, profile["matmul"]["dtypes"][trains_in]["best_flops"],
                                                    quick, DTYPES[trains_in])
        profile["layer_gemm_forward"] = measure_layer_gemms(
            device, profile["matmul"]["dtypes"][trains_in]["best_flops"], quick, DTYPES[trains_in], forward_only=True)
        profile["attention"] = measure_attention(device, best, quick)
        profile["elementwise"] = measure_elementwise(device, quick)
        profile["gemv"] = measure_gemv(device, quick)
        quant = measure_quant(device, quick) if measure_quant is not None else None
        if quant is not None:
            profile["quant_gemv"] = quant

    def memory():
        big = (1 << 30) if device.type == "cuda" else 512 * MiB
        profile["memory"] = measure_copy_bandwidth(device, big // 4 if quick else big, 3 if quick else 5)

    def dispatch():
        profile["dispatch"] = measure_op_overhead(device, repeats=5 if quick else 20)

    def disk():
        profile["disk"] = measure_disk(directory, (64 if quick else 256) * MiB)

    def allreduce():
        profile["allreduce"] = measure_allreduce(quick)

    def training():
        run_it = measure_runtime is not None and device.type == "cpu"
        profile["training_runtime"] = measure_runtime(directory) if run_it else None

    steps = [("system", system), ("matmul", matmul), ("training shapes", training_shapes),
             ("memory bandwidth", memory), ("dispatch", dispatch),
             ("disk", disk), ("all-reduce", allreduce), ("training runtime", training)]
    with tqdm(total=len(steps), disable=not progress, file=sys.stderr, unit="step", leave=False) as bar:
        for name, step in steps:
            bar.set_description(f"probe: {name}")
            step()
            bar.update()
    profile["duration_s"] = time.perf_counter() - start
    return profile


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--allreduce-worker":
        _allreduce_worker(*json.loads(argv[1]))
        return 0
    print("usage: hardy probe (this module's entry point is internal)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
