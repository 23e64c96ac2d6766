"""AWQ (Lin et al. 2023): activation-aware weight quantization. Weights that meet large activations
matter most; scaling their input channels up by s (and the producer of those activations down by s,
so the function is unchanged) shrinks their relative rounding error. The per-channel scale is
s = mean|x|^α, α searched on a grid to minimize the quantized output error on calibration data;
then each group's clipping range is searched the same way; then round-to-nearest.

Scales fold into the operator that produces the linear's input: the RMSNorm weight before q/k/v and
before gate/up, the up projection's rows before down, and the value projection's rows before the
output projection (only when there are as many K/V heads as query heads, as AWQ itself does).
"""
from __future__ import annotations

import torch

from hardy.compress.quant import QuantSpec, QuantTensor, grouped, rtn

GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 .. 0.55


def _output_error(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(((x @ (w_hat - w).t()) ** 2).mean())


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Per-input-channel scale s for linears sharing the input x [tokens, in] (s = 1 if nothing helps)."""
    x = x.float()
    x_mean = x.abs().mean(dim=0)
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(GRID):
        alpha = i / GRID
        s = x_mean.pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        loss = sum(_output_error(x, w.float(), rtn(w.float() * s, spec).dequantize() / s) for w in weights)
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w with each (row, group) clipped to the ratio of its range that minimizes that group's
    contribution to the output error on x [tokens, in]."""
    out, cols = w.shape
    groups, g = spec.groups(cols), spec.group_width(cols)
    xg = grouped(x.float(), g, fill="zero")
    wg = grouped(w.float(), g)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    if spec.symmetric:
        lo = -torch.maximum(lo.abs(), hi.abs())
        hi = -lo
    best_err = torch.full((out, groups), float("inf"))
    best = wg.clone()
    for r in CLIP_RATIOS:
        clipped = torch.minimum(torch.maximum(wg, lo * r), hi * r)
        delta = grouped(rtn(clipped.reshape(out, -1)[:, :cols], spec).dequantize(), g) - wg
        err = torch.einsum("ogk,tgk->ogt", delta, xg).pow(2).mean(-1)  # per (row, group)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], clipped, best)
    return best.reshape(out, -1)[:, :cols]


def awq_quantize(x: torch.Tensor, w: torch.Tensor, spec: QuantSpec) -> QuantTensor:
    """Clip search then round-to-nearest (after the scales have been folded into w)."""
    return rtn(search_clip(x, w, spec), spec)
