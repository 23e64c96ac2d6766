"""Global gradient norm and clipping across any mix of plain tensors and DTensor shards.

DTensor gradients are grouped by (mesh, placements); each group's local sum of squares is
all-reduced over the mesh dimensions it is sharded on (replicated dimensions hold copies). DDP
gradients are already averaged and identical on every rank, so they need no communication.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _sq_norm(t: torch.Tensor) -> torch.Tensor:
    # The norm is computed in the tensor's own precision (no full-size float64 copy of a 100 MB
    # gradient); only the per-tensor results are accumulated in float64.
    return torch.linalg.vector_norm(t).double().cpu() ** 2


def global_grad_norm(params) -> float:
    plain = torch.zeros((), dtype=torch.float64)
    groups: dict = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    meshes = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            key = (id(g.device_mesh), tuple(g.placements))
            meshes[key] = (g.device_mesh, g.placements)
            groups[key] = groups[key] + _sq_norm(g.to_local())
        else:
            plain += _sq_norm(g.detach())
    total = plain.item()
    for key, sq in groups.items():
        mesh, placements = meshes[key]
        t = sq.to(mesh.device_type)
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(t, group=mesh.get_group(dim))
        total += t.item()
    return math.sqrt(total)


@torch.no_grad()
def scale_grads(params, factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)
