"""This process's share of the training state, as plain tensors and numbers.

What a process holds (its FSDP/TP shards of the weights and optimizer moments, the optimizer's
hyperparameters as the schedule left them, the schedule, spike window, data position, step) is enough
to continue where it stopped, on the same layout. Live recovery sends it to a healing peer; in-memory
snapshots keep it in /dev/shm. Everything in it loads with `weights_only=True`.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def local_state(trainer, extra: dict | None = None) -> dict:
    params = trainable(trainer.model)
    optim = {}
    for i, p in enumerate(params):
        if p in trainer.optimizer.state:
            optim[str(i)] = {k: local(v) if torch.is_tensor(v) else v for k, v in trainer.optimizer.state[p].items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    return {"model": [local(p.detach()) for p in params], "optim": optim, "optim_groups": groups,
            "shapes": [list(local(p).shape) for p in params],
            "trainer": {"step": trainer.step, "skipped": trainer.skipped, "position": trainer.loader.position(),
                        "scheduler": trainer.scheduler.state_dict(), "spikes": trainer.spikes.state_dict(),
                        **(extra or {})}}


def fits(trainer, state: dict) -> bool:
    """The state was taken on this layout (the same shard of every tensor)."""
    return state.get("shapes") == [list(local(p).shape) for p in trainable(trainer.model)]


def load_local_state(trainer, state: dict) -> dict:
    """Copy `state` into the trainer; returns its trainer entry (for what the caller restores itself)."""
    params = trainable(trainer.model)
    optimizer = trainer.optimizer
    if state["optim"] and not optimizer.state:  # a fresh optimizer creates its state on its first step
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()  # its effect on the weights is overwritten below
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, value in zip(params, state["model"]):
            local(p).copy_(value)
        for i, p in enumerate(params):
            for k, v in state["optim"].get(str(i), {}).items():
                if torch.is_tensor(v):
                    local(optimizer.state[p][k]).copy_(v)
                else:
                    optimizer.state[p][k] = v
    for group, saved in zip(optimizer.param_groups, state["optim_groups"]):
        group.update(saved)  # the learning rate the schedule set: not in the scheduler's state
    t = state["trainer"]
    trainer.step, trainer.skipped = int(t["step"]), int(t["skipped"])
    trainer.scheduler.load_state_dict(t["scheduler"])
    trainer.spikes.load_state_dict(t["spikes"])
    trainer.loader.seek(int(t["position"]))
    return t
