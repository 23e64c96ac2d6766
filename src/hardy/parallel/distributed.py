"""Process-group setup from torchrun's environment, and small collective helpers."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hardy.errors import HardyError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Initialize torch.distributed when launched by torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise HardyError("parallel.backend = nccl needs CUDA GPUs; use gloo on CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout,
                                store=_attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                device_id=device if use_cuda else None)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _attempt_store(rank: int, world: int, timeout: timedelta):
    """torchrun's store, with keys private to this restart attempt.

    The elastic agent can hand every restart the same store; the process group's address keys
    left by the previous (killed) attempt would then be read by the new one, which dials dead
    ports and fails or stalls. A per-attempt prefix gives every restart a clean namespace.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]), world,
                          is_master=(not agent_store and rank == 0), timeout=timeout,
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"hardy/attempt_{attempt}/", store)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_max(value: float, device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized():
        return value
    value = value.detach().clone().double()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_together() -> None:
    """End a run whose ranks all reach this point: wait for every peer first, so no rank tears gloo
    down while another is still sending (seen: 'terminate called without an active exception')."""
    barrier()
    destroy()
