"""Global gradient norm and clipping across any mix of plain tensors and DTensor shards.

DTensor gradients are grouped by (mesh, placements); each group's local sum of squares is
all-reduced over the mesh dimensions it is sharded on (replicated dimensions hold copies). DDP
gradients are already averaged and identical on every rank, so they need no communication.

Everything stays on the device: the result is a tensor on the process group's device, and the
caller reads it back together with its other per-step scalars (one host sync per step).
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sq_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    # Each norm in the tensor's own precision (no float64 copy of a 100 MB gradient); only the
    # per-tensor results are accumulated in float64.
    norms = torch._foreach_norm(tensors)
    return torch.stack([n.double() for n in norms]).pow(2).sum()


def grad_sq_norm(params, device: torch.device) -> torch.Tensor:
    """Σ g² over every gradient of the model, all ranks included, as a float64 tensor on `device`.

    Gradients may live elsewhere (FSDP2 CPU offload keeps them in host memory): each group's small
    result moves to `device`, where the collectives run."""
    plain: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    groups: dict = defaultdict(list)
    meshes = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            key = (id(g.device_mesh), tuple(g.placements))
            meshes[key] = (g.device_mesh, g.placements)
            groups[key].append(g.to_local())
        else:
            plain[g.device].append(g.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for tensors in plain.values():
        total = total + _sq_sum(tensors).to(device)
    for key, tensors in groups.items():
        mesh, placements = meshes[key]
        sq = _sq_sum(tensors).to(device)
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total = total + sq
    return total


def global_grad_norm(params, device: torch.device | str = "cpu") -> float:
    """The global norm as a Python float (a host sync: for tests and tools, not the training step)."""
    return math.sqrt(float(grad_sq_norm(params, torch.device(device))))


@torch.no_grad()
def scale_grads(params, factor: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        torch._foreach_mul_(plain, factor)
    for g in grads:
        if isinstance(g, DTensor):
            g.mul_(factor)
