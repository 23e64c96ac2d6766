"""Dynamic loss scaling for fp16 (bf16 and fp32 need none), with torch's own scalers.

The scale multiplies the loss before backward and is divided out of the gradients (`unscale_`)
before the norm, clipping and the optimizer see them. A step whose gradients overflow is skipped
(the trainer's global non-finite check, the same on every rank) and the scale halves; after
`growth_interval` good steps in a row it doubles. Under torch.distributed the scaler is FSDP's
ShardedGradScaler, which all-reduces the overflow flag: every shard of a sharded model, and every
rank, then agrees on the scale. Everything stays on the device; nothing here reads a value back.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def make_grad_scaler(enabled: bool, device: torch.device, distributed: bool, init_scale: float,
                     growth_interval: int):
    kwargs = {"init_scale": init_scale, "growth_interval": growth_interval, "enabled": enabled}
    if enabled and distributed:
        return ShardedGradScaler(device=device.type, **kwargs)
    return torch.amp.GradScaler(device.type, **kwargs)


@contextlib.contextmanager
def quiet_unscale():
    """Unscaling DTensor gradients mixes them with the scaler's plain scalar tensors, which DTensor
    replicates with a warning on every step: expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*replicate.*scalar.*|.*scalar.*replicate.*")
        warnings.filterwarnings("ignore", module="torch.distributed.tensor")
        yield


def scale_tensor(scaler, device: torch.device) -> torch.Tensor:
    """The current scale as a float32 tensor on `device` (1 when scaling is off), for the step's one
    read-back."""
    scale = scaler._get_scale_async() if scaler.is_enabled() else None
    return torch.ones((), device=device) if scale is None else scale.reshape(()).to(device)


def load_scaler_state(scaler, state: dict, growth_interval: int) -> None:
    """Restore a checkpoint's scaler state; also reads the format of hardy's earlier scaler
    ({"scale", "good_steps"}) and a state saved without scaling (empty: the configured start)."""
    if not scaler.is_enabled() or not state:
        return
    if "good_steps" in state:
        state = {"scale": float(state["scale"]), "growth_factor": 2.0, "backoff_factor": 0.5,
                 "growth_interval": growth_interval, "_growth_tracker": int(state["good_steps"])}
    scaler.load_state_dict(state)
