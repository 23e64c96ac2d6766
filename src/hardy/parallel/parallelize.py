"""Apply parallelism, activation checkpointing and compilation to a meta-device model, from outside.

Order (as in torchtitan): tensor parallel -> activation checkpointing -> compile -> FSDP2 / DDP,
then materialize with `to_empty` and fill the weights (fresh init or a checkpoint), identically
on every layout: full tensors are generated from the seed and each rank keeps its shard, so a
sharded run starts from exactly the weights of a single-process run.
"""
from __future__ import annotations

import contextlib
import re
import warnings
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from hardy.devices import DTYPES
from hardy.errors import HardyError
from hardy.parallel.dims import WRAPS, ParallelDims


def preload() -> None:
    """Import every parallelism module and run the lazily initialized machinery once (a tiny
    checkpointed forward/backward and an AdamW step: their first use alone costs ~30 MB), so a run's
    measured memory is its own and does not depend on which features its configuration touches
    first. The trainer calls this before its memory meter starts."""
    # start-up: imported here, at the moment the trainer chooses: that is what this function is for
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    layer = nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters())
    checkpoint(layer, torch.ones(2, 4), use_reentrant=False).sum().backward()
    opt.step()


def wrapping(dims: ParallelDims, wrap: str = "auto") -> str | None:
    """The data-parallel wrapper: "fsdp", "ddp" or None. `auto` follows the degrees (FSDP2 when the
    shard degree is > 1, DDP when only replicas are); `fsdp` / `ddp` also wrap where the degree is 1 —
    FSDP2's mixed-precision policy and CPU offload on a single device, or the same code path as a
    multi-device run."""
    if wrap not in WRAPS:
        raise HardyError(f"parallel.wrap must be one of {', '.join(WRAPS)} (got {wrap!r})")
    if wrap == "auto":
        return "fsdp" if dims.uses_fsdp else "ddp" if dims.uses_ddp else None
    if wrap == "fsdp" and dims.dp_replicate > 1 and dims.dp_shard == 1:
        raise HardyError("parallel.wrap = fsdp with replicas only: set parallel.dp_shard (HSDP = replicas x shards)")
    if wrap == "ddp" and (dims.dp_shard > 1 or dims.tp > 1):
        raise HardyError("parallel.wrap = ddp replicates whole models: it cannot shard (dp_shard) or split (tp) them")
    return wrap


def build_mesh(dims: ParallelDims, device_type: str, wrap: str | None = None):
    """The device mesh; None for one process that no wrapper needs."""
    if dims.world_size == 1 and wrap is None:
        return None

    shape, names = dims.mesh_shape()
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


# Megatron-style: q/k/v and gate/up split by output rows (heads / hidden units), the matrices after
# them by input columns, so each block needs one all-reduce per attention and per MLP.
TP_PLAN = {"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
           "attention.wo": "rowwise", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
           "feed_forward.w2": "rowwise"}


def tp_kind(name: str) -> str | None:
    """How TP_PLAN splits a block's matrix given by parameter or module name ("layers.3.attention.wq.weight"
    -> "colwise"); None for what stays replicated (embeddings, LM head, norms)."""
    return TP_PLAN.get(re.sub(r"^layers\.\d+\.", "", name).removesuffix(".weight"))


def check_tp_degree(cfg, tp: int) -> None:
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % tp:
            raise HardyError(f"tensor parallel degree {tp} does not divide the model's {what} = {n}")


def apply_tp(model: nn.Module, mesh, shard_other=None) -> None:
    """Shard every block's attention and MLP over the mesh: float linears as DTensors. Layers that are
    not plain linears (quantized ones, inference only) go to `shard_other(block, name, kind, mesh)`,
    which returns True when it sharded one (hardy.compress.tensor_parallel slices stored codes)."""
    check_tp_degree(model.cfg, mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in model.layers:
        plan = {}
        for name, kind in TP_PLAN.items():
            if isinstance(block.get_submodule(name), nn.Linear):
                plan[name] = styles[kind]()
            elif shard_other is None or not shard_other(block, name, kind, mesh):
                raise HardyError(f"tensor parallel: {name} is a {type(block.get_submodule(name)).__name__}, "
                                 "which this sharding does not handle")
        if plan:
            parallelize_module(block, mesh, plan)


def selective_save_ops() -> set:
    """The operators whose outputs op-level selective checkpointing keeps: every matmul and attention
    (the FLOPs), and collectives (a recomputed one would talk to the other ranks a second time);
    norms, RoPE, SiLU, products and residual adds are recomputed (cheap, memory-bound)."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
        if c10d is not None and hasattr(c10d, name):
            ops.add(getattr(c10d, name).default)
    return ops


def selective_policy(save: set, random_ops: set):
    def policy(ctx, func, *args, **kwargs):
        # CUDA's dropout is one op (native_dropout): its mask is kept. On the CPU dropout is bernoulli_,
        # recomputed from the RNG state the checkpoint restores (preserve_rng_state): the same mask.
        return CheckpointPolicy.MUST_SAVE if func in save or func in random_ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """none | full | every:K (checkpoint every K-th block) | selective (every block, op level: keep
    matmul and attention outputs, recompute the rest). Returns how many blocks were wrapped."""
    if mode == "none":
        return 0

    every = 1 if mode in ("full", "selective") else int(mode.split(":", 1)[1])
    # With dropout the recomputed forward must draw the same masks as the first one.
    preserve_rng = model.cfg.dropout > 0
    extra = {}
    if mode == "selective":
        aten = torch.ops.aten
        random_ops = {aten.native_dropout.default}
        extra["context_fn"] = partial(create_selective_checkpoint_contexts,
                                      selective_policy(selective_save_ops(), random_ops))
    wrapped = 0
    for i, block in enumerate(model.layers):
        if i % every == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=preserve_rng, **extra)
            wrapped += 1
    return wrapped


def apply_compile(model: nn.Module) -> None:
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, dynamic=False)


def apply_fsdp(model: nn.Module, mesh, reshard_after_forward: bool, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, cpu_offload: bool, pin_memory: bool = False) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Offloaded: sharded parameters, gradients and optimizer states live in host memory (pinned for
    # asynchronous copies on CUDA), the optimizer steps on the CPU, each layer is all-gathered onto
    # the device for its forward and backward.
    offload = CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    # The root holds embeddings, final norm and the (possibly tied) LM head.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)


def fsdp_policies(model: nn.Module) -> dict | None:
    """What FSDP2 was really given, read back from its units (None without FSDP2): how many units,
    how many offload to the CPU, and the reduce dtype; recorded with each run so a setting that
    never reached FSDP2 shows."""
    groups = []
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        if group is not None:
            groups.append(group)
    if not groups:
        return None
    reduce = {str(g.mp_policy.reduce_dtype).removeprefix("torch.") for g in groups}
    return {"units": len(groups), "offloaded": sum(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups),
            "reduce_dtype": sorted(reduce)}


def fsdp_mesh(mesh, dims: ParallelDims):
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def low_precision_allreduce_hook(dtype: torch.dtype):
    """DDP comm hook: all-reduce gradient buckets in `dtype` (works on gloo and NCCL alike)."""
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        compressed = bucket.buffer().to(dtype).div_(dist.get_world_size(group))
        fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            out = bucket.buffer()
            out.copy_(fut.value()[0])
            return out

        return fut.then(decompress)

    return hook


def wrap_ddp(model: nn.Module, mesh, reduce_dtype: torch.dtype) -> nn.Module:
    with warnings.catch_warnings():  # newer torch renames broadcast_buffers; the rope tables need no sync
        warnings.filterwarnings("ignore", category=FutureWarning)
        ddp = DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group(),
                                      broadcast_buffers=False, gradient_as_bucket_view=True)
    if reduce_dtype != torch.float32:
        ddp.register_comm_hook(mesh["dp_replicate"].get_group(), low_precision_allreduce_hook(reduce_dtype))
    return ddp


def clean_name(name: str) -> str:
    """Parameter name without the wrappers' prefixes (activation checkpoint, compile, DDP)."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def assign_full_state(model: nn.Module, full) -> None:
    """Copy full (unsharded) tensors into parameters that may be DTensor shards; all must be covered.

    `full` is a dict or an iterable of (name, tensor) pairs, consumed one tensor at a time so a
    fresh initialization never holds a second copy of the whole model.
    """
    params = {clean_name(n): p for n, p in model.named_parameters()}
    done = set()
    for name, value in (full.items() if isinstance(full, dict) else full):
        name = clean_name(name)
        p = params.get(name)
        if p is None:
            continue
        if isinstance(p, DTensor):
            p.copy_(distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements))
        else:
            p.copy_(value.to(p.dtype))
        done.add(name)
    missing = sorted(set(params) - done)
    if missing:
        raise HardyError(f"no initial value for parameter(s) {', '.join(missing[:3])}")


def parallelize(model: nn.Module, dims: ParallelDims, mesh, device: torch.device, materialize, *, ac: str = "none",
                compile: bool = False, dtype: str = "fp32", reduce_dtype: str = "fp32",
                reshard_after_forward: bool = True, cpu_offload: bool = False, wrap: str = "auto") -> nn.Module:
    """Returns the module to train (a DDP wrapper for pure data parallelism).

    `materialize(model, device)` fills the weights after `to_empty` (before any DDP broadcast) and puts
    the buffers (RoPE tables) on `device`, where the forward runs.
    """
    wrapper = wrapping(dims, wrap)
    if cpu_offload and wrapper != "fsdp":
        raise HardyError("parallel.cpu_offload is FSDP2's: set parallel.dp_shard > 1, or parallel.wrap = \"fsdp\" "
                         "to offload on a single device")
    if dims.uses_tp:
        apply_tp(model, mesh["tp"])
    apply_activation_checkpointing(model, ac)
    if compile:
        apply_compile(model)
    param_dtype, red_dtype = DTYPES[dtype], DTYPES[reduce_dtype]
    if wrapper == "fsdp":
        apply_fsdp(model, fsdp_mesh(mesh, dims), reshard_after_forward, param_dtype, red_dtype, cpu_offload,
                   pin_memory=device.type == "cuda")
    elif wrapper == "ddp" and dims.uses_tp:
        raise HardyError("DDP combined with tensor parallelism is not supported: shard the data dimension "
                         "instead (parallel.dp_shard) for FSDP + TP")
    # FSDP2's CPU offload takes its sharded parameters in host memory (it copies them to the device per
    # layer); materialized on the device they would stay there and its first forward would fail.
    model.to_empty(device=materialize_device(device, cpu_offload))
    model.tie_weights()  # to_empty gives each module its own tensor; FSDP2 keeps the tie, plain modules do not
    materialize(model, device)
    if wrapper == "ddp":
        return wrap_ddp(model, mesh, red_dtype)
    return model


def materialize_device(device: torch.device, cpu_offload: bool) -> torch.device:
    """Where parameters are allocated: host memory when FSDP2 offloads them, else the compute device."""
    return torch.device("cpu") if cpu_offload else device


def autocast_context(device: torch.device, dtype: str, uses_fsdp: bool):
    """FSDP2 casts parameters itself (MixedPrecisionPolicy); other layouts use autocast."""
    if dtype == "fp32" or uses_fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype])


def grad_sync_context(model: nn.Module, sync: bool):
    """Skip gradient communication on all but the last micro-batch of an accumulation."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()
