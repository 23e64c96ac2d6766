"""Decode steps through the fused block (hardy.compress.csrc/decode_layer.cpp) where a model allows:
every block's seven linears quantized with the fused kernels attached, float32 weights and KV cache,
one process. All blocks are then one C++ call instead of ~25 operator calls per block from Python — at
SmolLM2's size that overhead, not reading the weights, was most of a decode step.

Anything else (float models, tensor parallel, prefill, a model the kernels could not be built for)
runs the model's own modules; `decode_hidden` is the single entry both `generate` and the serving
engine use, and tests/test_kernels.py checks the two paths agree.
"""
from __future__ import annotations

import torch

from hardy.compress.kernels import kernel_group, kernel_tensors, load
from hardy.compress.qlinear import QuantLinear
from hardy.model.llama import BLOCK_LINEARS, RMSNorm, TransformerBlock


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
    if module is not None and hasattr(module, "DecodeStack") and model.norm.weight.dtype == torch.float32:
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


def decode_hidden(model, tokens: torch.Tensor, start_pos: int | torch.Tensor) -> torch.Tensor:
    """Final normalized hidden states [B, 1, dim] for one new token per row (tokens [B, 1] at
    `start_pos`: an int for all rows, or a [B] tensor), with the KV cache set up: the fused blocks
    where they apply, else the modules."""
    fused = fused_blocks(model)
    caches = [layer.attention.kv_cache for layer in model.layers]
    positions = (start_pos if isinstance(start_pos, torch.Tensor)
                 else torch.full((tokens.shape[0],), start_pos, dtype=torch.long))
    if (fused is None or tokens.shape[1] != 1
            or any(c is None or c.k.dtype != torch.float32 or c.k.device.type != "cpu" for c in caches)
            or int(positions.max()) >= min(model._rope_len, caches[0].k.shape[2])
            or not (model.rope_cos.dtype == torch.float32 and model.rope_cos.is_contiguous())):
        return model.hidden_states(tokens, start_pos)
    x = model.tok_embeddings(tokens)[:, 0].float().contiguous()
    x = fused(x, positions.to(torch.long).contiguous(), model.rope_cos, model.rope_sin, [c.k for c in caches],
              [c.v for c in caches])
    return model.norm(x)[:, None]
