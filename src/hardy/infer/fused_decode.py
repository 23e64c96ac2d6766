"""Decode steps through the fused block stack (hardy.compress.csrc/decode_layer.cpp) where a model
allows: every block's linears quantized with the fused kernels attached (a mixture-of-experts block:
q, k, v, o and every expert's three, routed and grouped by expert inside the stack), float32 norms,
biases, routers and activations, the paged KV cache (hardy.infer.kv) on the CPU, one process. All blocks are then one
C++ call instead of ~25 operator calls per block from Python — at SmolLM2's size that overhead, not
reading the weights, was most of a decode step. The stack takes each family's options (q/k/v biases,
q/k norms, sandwich norms, GELU-tanh, query scale, soft-capping, sliding windows, local RoPE tables)
and reads the cache's fp32, bf16 or fp16 blocks in place through the block table.

Anything else (float models, tensor parallel, prefill, a model the kernels could not be built for, a
static cache) runs the model's own modules; `decode_hidden` is the single entry both `generate` and
the serving engine use, and tests/test_kernels.py checks the two paths agree.
"""
from __future__ import annotations

import weakref

import torch

from hardy.compress.kernels import kernel_group, kernel_tensors, load
from hardy.compress.qlinear import QuantLinear
from hardy.infer.kv import LayerKV
from hardy.model.moe import MoE
from hardy.model.transformer import BLOCK_LINEARS, RMSNorm, TransformerBlock

_NONE = torch.empty(0)  # an absent bias or norm
BIASED = ("attention.wq", "attention.wk", "attention.wv")


def _linears(block) -> list[str] | None:
    """The block's linears in the stack's order: q, k, v, o, then the MLP's gate, up, down or each
    expert's in turn (then the shared expert's); None for an MoE block the stack does not compute (a
    float or non-softmax router, a shared expert's gate that is not a float32 linear)."""
    ffn = block.feed_forward
    if not isinstance(ffn, MoE):
        return list(BLOCK_LINEARS)
    if not _float_linear(ffn.router) or ffn.moe.router != "softmax_topk" or ffn.moe.top_k > 64 \
            or (ffn.shared_gate is not None and not _float_linear(ffn.shared_gate)):
        return None
    shared = [f"feed_forward.shared.{w}" for w in ("w1", "w3", "w2")] if ffn.shared is not None else []
    return list(BLOCK_LINEARS[:4]) + [f"feed_forward.experts.{e}.{w}" for e in range(len(ffn.experts))
                                      for w in ("w1", "w3", "w2")] + shared


def _float_linear(layer) -> bool:
    return isinstance(layer, torch.nn.Linear) and layer.weight.dtype == torch.float32 and layer.bias is None


def _moe_args(block) -> tuple[torch.Tensor, list[int]]:
    """(router, [experts, top k, renormalize, shared expert]) of a block: an empty router and zeros for
    a dense one. The shared expert: 0 none, 1 added as it is, 2 scaled by sigmoid(gate · x), the
    gate's row then below the router's."""
    ffn = block.feed_forward
    if not isinstance(ffn, MoE):
        return _NONE, [0, 0, 0, 0]
    router = ffn.router.weight.detach()
    shared = 0 if ffn.shared is None else 1 if ffn.shared_gate is None else 2
    if shared == 2:
        router = torch.cat([router, ffn.shared_gate.weight.detach()])
    return router.contiguous(), [ffn.moe.n_experts, ffn.moe.top_k, int(ffn.moe.norm_topk_prob), shared]


def _block_args(block) -> tuple[list[torch.Tensor], list[int]] | None:
    names = _linears(block)
    if names is None:
        return None
    tensors, dims = [], []
    for name in names:
        layer = block.get_submodule(name)
        if not isinstance(layer, QuantLinear) or layer.kernel is None:
            return None
        if layer.bias is not None and name not in BIASED:  # the stack adds biases to q, k and v only
            return None
        tensors += kernel_tensors(layer)
        dims += [kernel_group(layer), layer.out_features]
    return tensors, dims


def _float(t) -> torch.Tensor:
    return _NONE if t is None else t.detach()


def _block_parts(block) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """(four norms, five extras: q/k/v biases, q/k norms) of a block, or None where one is not float32."""
    att = block.attention
    norms = [block.attention_norm, block.ffn_norm, block.post_attention_norm, block.post_ffn_norm]
    if not all(n is None or isinstance(n, RMSNorm) for n in norms):
        return None
    parts = [_float(None if n is None else n.weight) for n in norms]
    extras = [_float(getattr(att, name).bias) for name in ("wq", "wk", "wv")] + [
        _float(None if n is None else n.weight) for n in (att.q_norm, att.k_norm)]
    if not all(t.dtype == torch.float32 for t in parts + extras):
        return None
    return parts, extras


# Each model's DecodeStack, or None where the modules decode: built on a model's first decode and kept
# here rather than on the model (the model knows nothing of the extension; a copy of it builds its own).
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def use_fused_blocks(model, enabled: bool = True) -> None:
    """True: (re)build the fused step on the next decode, for blocks changed since the last one;
    False: the modules decode from now on."""
    if enabled:
        _STACKS.pop(model, None)
    else:
        _STACKS[model] = None


def fused_blocks(model):
    """The extension's DecodeStack holding every block's weights, or None where the fused step does
    not apply. Built once per model (after a module swap or sharding, call use_fused_blocks)."""
    if model in _STACKS:
        return _STACKS[model]
    module = load()
    fused = None
    cfg = model.cfg
    if module is not None and hasattr(module, "DecodeStack") and model.norm.weight.dtype == torch.float32:
        tensors, dims, norms, extras, routers, moe = [], [], [], [], [], []
        for block in model.layers:
            args = _block_args(block) if isinstance(block, TransformerBlock) else None
            parts = _block_parts(block) if args is not None else None
            if parts is None:
                tensors = None
                break
            tensors += args[0]
            dims += args[1]
            norms += parts[0]
            extras += parts[1]
            router, numbers = _moe_args(block)
            routers.append(router)
            moe += numbers
        if tensors:
            head_dim = model.layers[0].attention.head_dim
            windows = [cfg.window(i) or 0 for i in range(cfg.n_layers)]
            local = [int(model.local_rope and kind == "sliding") for kind in cfg.kinds]
            fused = module.DecodeStack(norms, tensors, dims, extras, windows, local, routers, moe, cfg.norm_eps, head_dim,
                                       cfg.mlp_act == "gelu_tanh", cfg.attn_scale or head_dim ** -0.5,
                                       cfg.attn_softcap or 0.0)
    _STACKS[model] = fused
    return fused


def decode_hidden(model, tokens: torch.Tensor, start_pos: int | torch.Tensor) -> torch.Tensor:
    """Final normalized hidden states [B, 1, dim] for one new token per row (tokens [B, 1] at
    `start_pos`: an int for all rows, or a [B] tensor), with the KV cache set up and its blocks reserved
    for these positions: the fused blocks where they apply, else the modules."""
    cache = model.layers[0].attention.kv_cache
    fused = fused_blocks(model) if isinstance(cache, LayerKV) else None
    if fused is None or tokens.shape[1] != 1 or cache.cache.pool.device.type != "cpu":
        return model.hidden_states(tokens, start_pos)
    pool, rows = cache.cache.pool, cache.cache.rows
    if isinstance(start_pos, torch.Tensor):
        positions, last = start_pos.to(torch.long).contiguous(), int(start_pos.max())
    else:
        positions, last = torch.full((tokens.shape[0],), start_pos, dtype=torch.long), start_pos
    if last >= model._rope_len or not (model.rope_cos.dtype == torch.float32 and model.rope_cos.is_contiguous()):
        return model.hidden_states(tokens, start_pos)
    local = model.local_rope
    x = model.embed(tokens)[:, 0].float().contiguous()
    x = fused(x, positions, model.rope_cos, model.rope_sin, model.rope_cos_local if local else model.rope_cos,
              model.rope_sin_local if local else model.rope_sin, pool.blocks, pool.tables[rows].contiguous())
    return model.norm(x)[:, None]
