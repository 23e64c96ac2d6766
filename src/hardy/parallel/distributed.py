"""Process-group setup from torchrun's environment, and small collective helpers."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hardy.devices import check_cuda_index
from hardy.errors import HardyError

_store = None  # this attempt's rendezvous store (see _attempt_store), for waits longer than a collective's timeout


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


def init_distributed(backend: str = "auto", timeout_s: float = 600.0, single_group: bool = False) -> DistEnv:
    """Initialize torch.distributed when launched by torchrun (WORLD_SIZE > 1); `single_group`: also
    for one process without torchrun (a one-rank group on an in-memory store, for DDP/FSDP2 wrappers)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise HardyError("parallel.backend = nccl needs CUDA GPUs; use gloo on CPU")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        check_cuda_index(local_rank)  # e.g. --nproc 2 on a one-GPU machine: say so, do not ask for cuda:1
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        global _store
        timeout = timedelta(seconds=timeout_s)
        _store = _attempt_store(rank, world, timeout)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout, store=_store, rank=rank,
                                world_size=world, device_id=device if use_cuda else None)
    elif single_group and world == 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, timeout=timedelta(seconds=timeout_s))
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


def _attempt_store(rank: int, world: int, timeout: timedelta):
    """torchrun's store, with keys private to this restart attempt.

    One node (the agent's own store, shared by every restart): the process group's address keys left
    by a previous (killed) attempt would be read by the new one, which dials dead ports and fails or
    stalls, so each attempt gets a prefix of its own. Several nodes: `hardy launch` has rank 0 host a
    fresh store every round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and no prefix is needed — nor
    possible, as a replacement node's restart count starts again at 0 while the others' do not.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]), world,
                          is_master=(not agent_store and rank == 0), timeout=timeout,
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"hardy/attempt_{attempt}/" if agent_store else "hardy/", store)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks, in place, on the tensor's own device (the process group's: NCCL reduces
    CUDA tensors only). No host synchronization."""
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def main_rank_does(name: str, work, rank: int, timeout_s: float):
    """Rank 0 runs `work()`; the others wait for it on the rendezvous store — not in a collective, whose
    timeout (10 min) a long job such as preparing a big corpus would exceed. A failure on rank 0 reaches
    the others as the same one-line error."""
    if _store is None:
        return work() if rank == 0 else None
    key = f"done/{name}"
    if rank == 0:
        try:
            result = work()
        except HardyError as e:
            _store.set(key, f"error:{e}")
            raise
        except BaseException:
            _store.set(key, f"error:{name} failed on rank 0")
            raise
        _store.set(key, "ok")
        return result
    _store.wait([key], timedelta(seconds=timeout_s))
    status = _store.get(key).decode()
    if status != "ok":
        raise HardyError(status.removeprefix("error:"))
    return None


def gather_strings(name: str, value: str, rank: int, world: int, timeout_s: float) -> list[str]:
    """Every rank's `value`, in rank order, exchanged through the rendezvous store: a wait as long as
    `timeout_s`, where a collective would end at the process group's timeout. One process: [value]."""
    if _store is None or world == 1:
        return [value]
    _store.set(f"gather/{name}/{rank}", value)
    keys = [f"gather/{name}/{r}" for r in range(world)]
    _store.wait(keys, timedelta(seconds=timeout_s))
    return [_store.get(k).decode() for k in keys]


def share_from_main(name: str, value: str, rank: int, timeout_s: float = 600.0) -> str:
    """Rank 0's `value` on every rank, through the rendezvous store (what rank 0 sees decides)."""
    if _store is None:
        return value
    key = f"share/{name}"
    if rank == 0:
        _store.set(key, value)
        return value
    _store.wait([key], timedelta(seconds=timeout_s))
    return _store.get(key).decode()


def destroy() -> None:
    global _store
    if dist.is_initialized():
        dist.destroy_process_group()
    _store = None


_left = False  # leave_together ran: `python -m hardy` then ends this worker without finalization


def leave_together() -> None:
    """End a run whose ranks all reach this point: wait for every peer first, so no rank tears gloo
    down while another is still sending (seen: 'terminate called without an active exception')."""
    global _left
    barrier()
    destroy()
    _left = True


def left_together() -> bool:
    return _left
