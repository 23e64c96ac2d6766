"""Device choice and CUDA settings, shared by every command (core: imports nothing of hardy but errors).

`--device auto` means CUDA when one is visible for float models, else the CPU: hardy's quantized decode
kernels are CPU code, so a quantized model stays on the CPU unless CUDA is asked for by name.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from hardy.errors import HardyError

# The compute dtypes hardy's options name (--dtype, precision.dtype, the probe): the one map of them.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# cuBLAS picks reduction orders per workspace; a fixed workspace makes its GEMMs repeatable
# (NVIDIA's cuBLAS docs, "Results reproducibility"). Read once, when cuBLAS first starts.
CUBLAS_DETERMINISTIC = ":4096:8"


def cpuinfo_fields() -> dict[str, list[str]]:
    """/proc/cpuinfo as {key: [its value on each processor]}; empty where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), []).append(value.strip())
    return fields


def cpu_flags(fields: dict[str, list[str]] | None = None) -> set[str]:
    """The CPU's feature flags (x86 lists them as "flags", arm64 as "Features")."""
    fields = cpuinfo_fields() if fields is None else fields
    return set((fields.get("flags") or fields.get("Features") or [""])[0].split())


def resolve_device(spec: str | None, quantized: bool = False) -> torch.device:
    """`auto` / None -> cuda:0 for a float model when CUDA is available, else cpu; `cpu`; `cuda` or
    `cuda:N` (a one-line error where that GPU does not exist)."""
    spec = spec or "auto"
    if spec == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() and not quantized else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise HardyError(f"--device {spec!r}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise HardyError(f"--device {spec!r}: hardy runs on cpu or cuda")
    check_cuda_index(0 if device.index is None else device.index)
    return torch.device("cuda", device.index or 0)


def check_cuda_index(index: int) -> None:
    """A one-line error naming what is visible, before anything asks for a GPU that is not there."""
    if not torch.cuda.is_available():
        raise HardyError("CUDA was asked for, but no CUDA device is visible (this torch build: "
                         f"{torch.__version__}); use --device cpu")
    count = torch.cuda.device_count()
    if index >= count:
        raise HardyError(f"cuda:{index} was asked for, but {count} CUDA device(s) are visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): "
                         "start one process per GPU")


def configure_cuda(deterministic: bool, tf32: bool) -> list[str]:
    """Settings that must precede the first cuBLAS call; returns what was set, for the start-up log.

    deterministic: a fixed cuBLAS workspace (unless the user set one), cuDNN's deterministic
    algorithms and no autotuning. tf32: fp32 matmuls and convolutions on TF32 tensor cores (10-bit
    mantissa inputs, fp32 accumulation), what most trainers default to on Ampere and newer."""
    notes = []
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        notes.append(f"deterministic (CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']})")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    notes.append("TF32 matmul on" if tf32 else "TF32 off (true fp32 matmul)")
    return notes


def compute_device(model) -> torch.device:
    """Where a model computes: its RoPE tables' device (they stay with the forward even where the
    weights live elsewhere, as under FSDP2's CPU offload), else its first tensor's, else the CPU."""
    rope = getattr(model, "rope_cos", None)
    if isinstance(rope, torch.Tensor):
        return rope.device
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


NUMA_ROOT = "/sys/devices/system/node"


def parse_cpulist(text: str) -> list[int]:
    """The kernel's CPU-list format ("0-3,8-11", "" for a node without CPUs) as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_cpus(root: str = NUMA_ROOT) -> list[list[int]]:
    """The CPUs of each NUMA node that has any (memory-only nodes left out), in node order; [] where
    the system does not say (not Linux, no sysfs)."""
    nodes = []
    try:
        for path in Path(root).iterdir():
            match = re.fullmatch(r"node(\d+)", path.name)
            if match and (path / "cpulist").is_file():
                nodes.append((int(match.group(1)), parse_cpulist((path / "cpulist").read_text())))
    except (OSError, ValueError):
        return []
    return [cpus for _, cpus in sorted(nodes) if cpus]


def bind_to_numa_node(local_rank: int, nproc: int, root: str = NUMA_ROOT) -> tuple[int, list[int]] | None:
    """Pin this process to one NUMA node's CPUs, ranks spread over the nodes in blocks (2 nodes, 4
    ranks: 0 1 | 2 3), before it allocates anything: Linux places a page on the node of the CPU that
    first touches it, so a tensor-parallel worker's slices then sit in its own socket's DRAM and the
    sockets' bandwidth adds up. Only CPUs this process may already use are taken. Returns (node,
    CPUs), or None where there is one node (nothing to choose) or the node has none of ours."""
    nodes = numa_cpus(root)
    if len(nodes) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    node = local_rank * len(nodes) // max(nproc, 1) % len(nodes)
    cpus = sorted(set(nodes[node]) & os.sched_getaffinity(0))
    if not cpus:
        return None
    os.sched_setaffinity(0, cpus)
    return node, cpus
