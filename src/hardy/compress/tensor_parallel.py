"""Tensor parallelism for quantized layers (inference): DTensor shards float parameters, but a
`QuantLinear` holds packed codes and per-group scales, so it is sharded by slicing what it stores —
output rows for the column-parallel matrices (no communication), input columns for the row-parallel
ones (whole quantization groups per process, then one all-reduce of the partial outputs). Each
process then runs its slice through the same fused kernels as a single process would."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hardy.compress.kernels import prepare
from hardy.compress.qlinear import QuantLinear
from hardy.errors import HardyError
from hardy.formats.gguf_quant import TPSlice
from hardy.formats.quantized import QuantSpec, QuantTensor
from hardy.parallel.parallelize import tp_kind


class RowParallelQuantLinear(nn.Module):
    """This process's input-column slice of a quantized matrix; the partial outputs are summed (then the
    bias, once)."""

    def __init__(self, local: QuantLinear, group):
        super().__init__()
        self.bias, local.bias = local.bias, None
        self.local = local
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def check_split(name: str, spec: QuantSpec, shape: tuple[int, int], kind: str, parts: int) -> None:
    """A quantized matrix splits into `parts` only along whole rows, or whole quantization groups."""
    out, cols = shape
    if kind == "colwise":
        if out % parts:
            raise HardyError(f"{name}: {out} rows do not split into {parts} processes")
        return
    width = spec.super_block or spec.group_width(cols)  # the K-quant form splits along whole super-blocks
    if cols % parts or not (spec.groups(cols) == 1 or (cols // parts) % width == 0):
        raise HardyError(f"--tp {parts}: {name} has {cols} columns in quantization groups of {width}, which do "
                         f"not split into {parts} processes along whole groups")


def slice_quantized(qt: QuantTensor, kind: str, rank: int, parts: int, name: str) -> QuantTensor:
    check_split(name, qt.spec, qt.shape, kind, parts)
    out, cols = qt.shape
    if kind == "colwise":
        rows = slice(*TPSlice(kind, rank, parts).span(out))
        return QuantTensor(qt.codes[rows], qt.scale[rows], None if qt.mins is None else qt.mins[rows], qt.spec,
                           None if qt.supers is None else qt.supers[rows])
    width, local = qt.spec.group_width(cols), cols // parts
    c = slice(rank * local, (rank + 1) * local)
    # one scale per row (per-channel, or a group as wide as the row): every column slice keeps it
    g = slice(None) if qt.spec.groups(cols) == 1 else slice(rank * local // width, (rank + 1) * local // width)
    supers = None
    if qt.supers is not None:
        supers = qt.supers[:, rank * local // qt.spec.super_block:(rank + 1) * local // qt.spec.super_block]
    return QuantTensor(qt.codes[:, c], qt.scale[:, g], None if qt.mins is None else qt.mins[:, g], qt.spec, supers)


def rank_slices(rank: int, parts: int):
    """name -> the TPSlice this rank loads for a matrix TP_PLAN shards, None for the replicated ones
    (embeddings, LM head, norms)."""
    def slice_for(name: str) -> TPSlice | None:
        kind = tp_kind(name)
        return TPSlice(kind, rank, parts) if kind else None

    return slice_for


def shard_quantized_linear(block: nn.Module, name: str, kind: str, mesh) -> bool:
    """Replace `block.<name>`, if it is a QuantLinear, by this rank's slice of it — or, where the loader
    read only this rank's part (`tp_slice`), wire that part up as it is. False for anything else
    (hardy.parallel.parallelize.apply_tp's `shard_other`)."""
    parent_name, _, child = name.rpartition(".")
    parent = block.get_submodule(parent_name)
    full = getattr(parent, child)
    if not isinstance(full, QuantLinear):
        return False
    want = TPSlice(kind, mesh.get_local_rank(), mesh.size())
    if full.tp_slice is not None:
        if full.tp_slice != want:
            raise HardyError(f"{name}: loaded as {full.tp_slice}, but this process is {want}")
        local = full
    else:
        local = QuantLinear(slice_quantized(full.quant_tensor(), kind, want.rank, want.parts, name))
        local.tp_slice = want
        if full.kernel is not None:
            prepare(local)  # the fused decode kernel, for the slice
    if full.bias is not None:  # loaded whole: a column-parallel rank keeps its rows' part
        bias = full.bias.detach()
        local.bias = nn.Parameter(bias[slice(*want.span(bias.numel()))].clone() if kind == "colwise" else bias)
    setattr(parent, child, local if kind == "colwise" else RowParallelQuantLinear(local, mesh.get_group()))
    return True
