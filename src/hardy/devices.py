"""Device choice and CUDA settings, shared by every command (core: imports nothing of hardy but errors).

`--device auto` means CUDA when one is visible for float models, else the CPU: hardy's quantized decode
kernels are CPU code, so a quantized model stays on the CPU unless CUDA is asked for by name.
"""
from __future__ import annotations

import os

import torch

from hardy.errors import HardyError

# cuBLAS picks reduction orders per workspace; a fixed workspace makes its GEMMs repeatable
# (NVIDIA's cuBLAS docs, "Results reproducibility"). Read once, when cuBLAS first starts.
CUBLAS_DETERMINISTIC = ":4096:8"


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
