"""Decode steps through the fused block (hardy.compress.csrc/decode_layer.cpp) where a model allows:
every block's seven linears quantized with the fused kernels attached, float32 weights and KV cache,
one process. Each block is then one C++ call instead of ~25 operator calls from Python — at
SmolLM2's size that overhead, not reading the weights, was most of a decode step.

Anything else (float models, tensor parallel, prefill, a model the kernels could not be built for)
runs the model's own modules; `decode_hidden` is the single entry both `generate` and the serving
engine use, and tests/test_kernels.py checks the two paths agree.
"""
from __future__ import annotations

import torch


def _block_args(block) -> tuple[list[torch.Tensor], list[int]] | None:
    from hardy.compress.kernels import kernel_group
    from hardy.compress.qlinear import QuantLinear
    from hardy.model.llama import BLOCK_LINEARS

    tensors, groups = [], []
    for name in BLOCK_LINEARS:
        layer = block.get_submodule(name)
        if not isinstance(layer, QuantLinear) or layer.kernel is None:
            return None
        mins = layer.mins if layer.mins is not None else torch.empty(0, dtype=torch.float16)
        tensors += [layer.qweight, layer.scales, mins]
        groups.append(kernel_group(layer))
    return tensors, groups


def fused_blocks(model) -> tuple | None:
    """(the extension, per block (weights, groups, norms)), or None where the fused step does not
    apply. Computed once per model (a module swap or sharding after that is not expected)."""
    cached = getattr(model, "_fused_decode", False)
    if cached is not False:
        return cached
    from hardy.compress.kernels import load
    from hardy.model.llama import RMSNorm, TransformerBlock

    module = load()
    blocks = None
    if module is not None and hasattr(module, "decode_layer") and model.norm.weight.dtype == torch.float32:
        blocks = []
        for block in model.layers:
            args = _block_args(block) if isinstance(block, TransformerBlock) else None
            norms = (block.attention_norm, block.ffn_norm) if args else ()
            if args is None or not all(isinstance(n, RMSNorm) for n in norms):
                blocks = None
                break
            blocks.append((*args, block.attention_norm.weight.detach(), block.ffn_norm.weight.detach()))
    model._fused_decode = (module, blocks) if blocks else None
    return model._fused_decode


def decode_hidden(model, tokens: torch.Tensor, start_pos: int | torch.Tensor) -> torch.Tensor:
    """Final normalized hidden states [B, 1, dim] for one new token per row (tokens [B, 1] at
    `start_pos`: an int for all rows, or a [B] tensor), with the KV cache set up: the fused blocks
    where they apply, else the modules."""
    fused = fused_blocks(model)
    caches = [layer.attention.kv_cache for layer in model.layers]
    positions = (start_pos if isinstance(start_pos, torch.Tensor)
                 else torch.full((tokens.shape[0],), start_pos, dtype=torch.long))
    if (fused is None or tokens.shape[1] != 1 or any(c is None or c.k.dtype != torch.float32 for c in caches)
            or int(positions.max()) >= min(model._rope_len, caches[0].k.shape[2])
            or not (model.rope_cos.dtype == torch.float32 and model.rope_cos.is_contiguous())):
        return model.hidden_states(tokens, start_pos)
    module, blocks = fused
    eps = model.cfg.norm_eps
    head_dim = model.layers[0].attention.head_dim
    positions = positions.to(torch.long).contiguous()
    x = model.tok_embeddings(tokens)[:, 0].float().contiguous()
    for (tensors, groups, attn_norm, ffn_norm), cache in zip(blocks, caches):
        x = module.decode_layer(x, positions, model.rope_cos, model.rope_sin, attn_norm, ffn_norm, eps,
                                tensors, groups, cache.k, cache.v, head_dim)
    return model.norm(x)[:, None]
