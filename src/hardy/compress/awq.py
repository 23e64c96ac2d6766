"""AWQ (Lin et al. 2023): activation-aware weight quantization. Weights that meet large activations
matter most; scaling their input channels up by s (and the producer of those activations down by s,
so the function is unchanged) shrinks their relative rounding error. The per-channel scale is
s = mean|x|^α (or AutoAWQ's s = mean|x|^α / salience(w)^(1−α)), α and the form searched on a grid to
minimize the quantized output error on calibration data (α = 0 is s = 1, plain RTN); then each
group's clipping range is searched the same way (both ends of an asymmetric grid); then round-to-nearest.

Scales fold into the operator that produces the linear's input: the RMSNorm weight before q/k/v and
before gate/up, the up projection's rows before down, and the value projection's rows before the
output projection (only when there are as many K/V heads as query heads, as AWQ itself does).
"""
from __future__ import annotations

import torch

from hardy.formats.quantized import QuantSpec, QuantTensor, fake_quantize, fake_quantize_groups, grouped, rtn

GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 .. 0.55


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """XᵀX / tokens: the output error of any weight change Δ on x is then mean((xΔᵀ)²) = Σ_o Δ_o·M·Δ_o / out,
    computed without touching the tokens again (every candidate of the searches below is scored this way)."""
    x = x.float()
    return x.t() @ x / x.shape[0]


def _output_error(m: torch.Tensor, delta: torch.Tensor) -> float:
    return float(((delta @ m) * delta).sum() / delta.shape[0])


def _weight_salience(weights: list[torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Per input channel, the mean over all rows of |w| relative to the max |w| of its group."""
    cols = weights[0].shape[1]
    w = torch.cat([w.float() for w in weights])
    wg = grouped(w.abs(), spec.group_width(cols))
    rel = (wg / wg.amax(-1, keepdim=True).clamp_min(1e-6)).reshape(w.shape[0], -1)[:, :cols]
    return rel.mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor):
    """The grid searched: s = mean|x|^α (the paper) and s = mean|x|^α / salience(w)^(1-α) (AutoAWQ's
    "duo" form: channels whose weights are small within their groups lose most to rounding), each
    normalized so that max·min = 1."""
    for i in range(GRID):
        alpha = i / GRID
        for s in (x_mean.pow(alpha), x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)):
            s = s.clamp_min(1e-4)
            yield s / (s.max() * s.min()).sqrt()


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Per-input-channel scale s for linears sharing the input x [tokens, in] (s = 1 if nothing helps)."""
    m = second_moment(x)
    x_mean = x.float().abs().mean(dim=0)
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for s in candidate_scales(x_mean, _weight_salience(weights, spec)):
        loss = sum(_output_error(m, fake_quantize(w.float() * s, spec) / s - w.float()) for w in weights)
        if loss < best:
            best, best_s = loss, s
    return best_s


def search_clip(x: torch.Tensor, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """w with each (row, group) clipped to the range that minimizes that group's contribution to the
    output error on x [tokens, in]. AWQ shrinks a group's range by one ratio; an asymmetric grid has two
    ends, so hardy searches the ratio of each end (CLIP_RATIOS², then each group's best pair refined in
    steps of 0.025 and 0.0125), a symmetric grid one ratio."""
    out, cols = w.shape
    groups, g = spec.groups(cols), spec.group_width(cols)
    xg = grouped(x.float(), g, fill="zero")  # zero-padded columns add nothing to any error
    m = torch.einsum("tgk,tgl->gkl", xg, xg) / x.shape[0]  # each group's second moment
    wg = grouped(w.float(), g)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    if spec.symmetric:
        lo = -torch.maximum(lo.abs(), hi.abs())
        hi = -lo
    best_err = torch.full((out, groups, 1), float("inf"), device=w.device)
    best_lo, best_hi = torch.ones_like(lo), torch.ones_like(hi)

    def clip(r_lo, r_hi) -> torch.Tensor:
        return torch.minimum(torch.maximum(wg, lo * r_lo), hi * r_hi)

    def consider(r_lo, r_hi) -> None:
        nonlocal best_err, best_lo, best_hi
        # the padding of a narrower last group repeats its last column, as rtn's own grouping does, and
        # meets zero rows of m: the same errors as quantizing the clipped [out, in] matrix
        delta = fake_quantize_groups(clip(r_lo, r_hi), spec) - wg
        err = (torch.matmul(delta.transpose(0, 1), m).transpose(0, 1) * delta).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, r_lo, best_lo), torch.where(better, r_hi, best_hi)

    if spec.symmetric:
        for r in CLIP_RATIOS:
            consider(torch.tensor(r, device=w.device), torch.tensor(r, device=w.device))
    else:
        for r_lo in CLIP_RATIOS:
            for r_hi in CLIP_RATIOS:
                consider(torch.tensor(r_lo, device=w.device), torch.tensor(r_hi, device=w.device))
        for step in (0.025, 0.0125):
            centre_lo, centre_hi = best_lo, best_hi
            for d_lo in (-step, 0.0, step):
                for d_hi in (-step, 0.0, step):
                    if d_lo or d_hi:
                        consider((centre_lo + d_lo).clamp(max=1.0), (centre_hi + d_hi).clamp(max=1.0))
    return clip(best_lo, best_hi).reshape(out, -1)[:, :cols]


def awq_quantize(x: torch.Tensor, w: torch.Tensor, spec: QuantSpec) -> QuantTensor:
    """Clip search then round-to-nearest (after the scales have been folded into w)."""
    return rtn(search_clip(x, w, spec), spec)
