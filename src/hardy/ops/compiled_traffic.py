"""The memory traffic of a torch.compile'd transformer block: the bytes inductor's fused kernels read and
write (its own count, per fused kernel), GEMMs and attention left out as they are in the eager count
(`hardy.ops.kernel_probe.ElementwiseTraffic`). The planner's `--compile` applies it: fusion is what
compile changes in a block's memory-bound work.

Counted on the CPU backend; inductor's fusion decisions are made by its scheduler before code generation,
shared with the GPU (Triton) backend, so the count stands for what a compiled block moves on a GPU too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch._functorch import config as functorch_config
from torch._inductor import compile_fx, config, metrics
from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

from hardy.errors import HardyError
from hardy.model.transformer import Rotary


@dataclass(frozen=True)
class CompiledTraffic:
    bytes: int  # read and written by the fused (generated) kernels
    kernels: int  # launched: generated and extern (GEMM, attention) kernels


def compiled_layer_traffic(block: torch.nn.Module, x: torch.Tensor, rope: Rotary) -> CompiledTraffic:
    """What the kernels of one compiled forward + backward of `block` move, and how many there are."""
    block.zero_grad(set_to_none=True)
    return compiled_traffic(block, x, rope)


def compiled_traffic(fn, x: torch.Tensor, *args) -> CompiledTraffic:
    """What the kernels of one compiled forward + backward of `fn(x, *args)` (its output summed) move, and
    how many there are: a block, or a loss over logits `x`."""
    log = compile_fx.inductor_metrics_log  # inductor counts bytes per fused kernel only while it is enabled
    level, propagate = log.level, log.propagate
    quiet = logging.NullHandler()
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(quiet)
    metrics.reset()
    torch._dynamo.reset()
    try:
        x = x.detach().requires_grad_(True)
        # a cached graph is not generated again, and only generation counts
        with config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
            torch.compile(fn)(x, *args).sum().backward()
        nodes = list(metrics.nodes_num_elem)
    finally:
        log.removeHandler(quiet)
        log.setLevel(level)
        log.propagate = propagate
        torch._dynamo.reset()
    if not nodes:
        raise HardyError("inductor reported no kernels for the compiled function")
    fused = [node for node, _ in nodes if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode))]
    return CompiledTraffic(bytes=sum(node.get_read_write_buffers_sizes() for node in fused),
                           kernels=sum(not isinstance(node, NopKernelSchedulerNode) for node, _ in nodes))
