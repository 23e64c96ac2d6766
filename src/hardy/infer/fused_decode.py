"""Decode steps through the fused block (hardy.compress.csrc/decode_layer.cpp) where a model allows:
every block's seven linears quantized with the fused kernels attached, float32 weights and KV cache,
one process. All blocks are then one C++ call instead of ~25 operator calls per block from Python — at
SmolLM2's size that overhead, not reading the weights, was most of a decode step.

Anything else (float models, tensor parallel, prefill, a model the kernels could not be built for)
runs the model's own modules; `decode_hidden` is the single entry both `generate` and the serving
engine use, and tests/test_kernels.py checks the two paths agree.
"""
from __future__ import annotations

import weakref

import torch

from hardy.compress.kernels import kernel_group, kernel_tensors, load
from hardy.compress.qlinear import QuantLinear
from hardy.model.transformer import BLOCK_LINEARS, RMSNorm, TransformerBlock


def _block_args(block) -> tuple[list[torch.Tensor], list[int]] | None:
    tensors, dims = [], []
    for name in BLOCK_LINEARS:
        layer = block.get_submodule(name)
        if not isinstance(layer, QuantLinear) or layer.kernel is None:
            return None
        tensors += kernel_tensors(layer)
        dims += [kernel_group(layer), layer.out_features]
    return tensors, dims


def fused_blocks(model) -> tuple | None:
    """The extension's DecodeStack holding every block's weights, or None where the fused step does
    not apply. Built once per model (a module swap or sharding after that is not expected)."""
    cached = getattr(model, "_fused_decode", False)
    if cached is not False:
        return cached

    module = load()
    fused = None
    c = model.cfg
    plain = not (c.attn_bias or c.qk_norm or c.sandwich_norms or c.mlp_act != "silu" or c.attn_scale is not None
                 or c.attn_softcap or c.sliding_window or c.rope_local_theta is not None)
    if plain and module is not None and hasattr(module, "DecodeStack") and model.norm.weight.dtype == torch.float32:
        tensors, dims, norms = [], [], []
        for block in model.layers:
            args = _block_args(block) if isinstance(block, TransformerBlock) else None
            if args is None or not all(isinstance(n, RMSNorm) for n in (block.attention_norm, block.ffn_norm)):
                tensors = None
                break
            tensors += args[0]
            dims += args[1]
            norms += [block.attention_norm.weight.detach(), block.ffn_norm.weight.detach()]
        if tensors:
            fused = module.DecodeStack(norms, tensors, dims, model.cfg.norm_eps, model.layers[0].attention.head_dim)
    model._fused_decode = fused
    return fused


def _fused_caches(model, caches: list) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The K and V tensors of `caches` when the fused step can write them all (float32, on the CPU),
    else None. Remembered (weakly: a cleared cache's memory is freed) for the last set of cache
    objects, which a generation or a serving engine reuses for every step: checking 2 x n_layers
    buffers through nn.Module attribute lookups each step cost more than the embedding, norm and
    argmax together."""
    memo = model.__dict__.get("_fused_caches_memo")
    if memo is not None and len(memo[0]) == len(caches) and all(a() is b for a, b in zip(memo[0], caches)):
        if memo[1] is None:
            return None
        keys, values = [r() for r in memo[1]], [r() for r in memo[2]]
        if all(t is not None for t in keys) and all(t is not None for t in values):
            return keys, values
    if not all(c is not None for c in caches):
        model.__dict__.pop("_fused_caches_memo", None)
        return None
    keys, values = [c.k for c in caches], [c.v for c in caches]
    fits = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in keys + values)
    model.__dict__["_fused_caches_memo"] = ([weakref.ref(c) for c in caches],
                                            [weakref.ref(t) for t in keys] if fits else None,
                                            [weakref.ref(t) for t in values] if fits else None)
    return (keys, values) if fits else None


def decode_hidden(model, tokens: torch.Tensor, start_pos: int | torch.Tensor) -> torch.Tensor:
    """Final normalized hidden states [B, 1, dim] for one new token per row (tokens [B, 1] at
    `start_pos`: an int for all rows, or a [B] tensor), with the KV cache set up: the fused blocks
    where they apply, else the modules."""
    fused = fused_blocks(model)
    if fused is None or tokens.shape[1] != 1:
        return model.hidden_states(tokens, start_pos)
    views = _fused_caches(model, [layer.attention.kv_cache for layer in model.layers])
    if isinstance(start_pos, torch.Tensor):
        positions, last = start_pos, int(start_pos.max())
    else:
        positions, last = torch.full((tokens.shape[0],), start_pos, dtype=torch.long), start_pos
    if (views is None or last >= min(model._rope_len, views[0][0].shape[2])
            or not (model.rope_cos.dtype == torch.float32 and model.rope_cos.is_contiguous())):
        return model.hidden_states(tokens, start_pos)
    x = model.embed(tokens)[:, 0].float().contiguous()
    x = fused(x, positions.to(torch.long).contiguous(), model.rope_cos, model.rope_sin, views[0], views[1])
    return model.norm(x)[:, None]
