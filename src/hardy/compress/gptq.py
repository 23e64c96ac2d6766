"""GPTQ (Frantar et al. 2022): quantize a linear layer's columns one at a time, each time spreading
the rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer-output error, H = 2·XᵀX over calibration activations X.

Faithful to the paper's algorithm: dampening (a fraction of the mean diagonal added to H), the
Cholesky form of H⁻¹, lazy batch updates (blocks of 128 columns, the trailing matrix updated once per
block), and act-order (columns with the largest Hessian diagonal first — without it GPTQ can lose to
RTN). With act-order the group parameters are fixed from the unquantized weights before the pass
("static groups"), so a group's columns may be quantized in any order and the stored layout stays
plain group-wise; without it each group's parameters come from the error-updated weights as the pass
reaches the group, as in the paper. Pruned weights (a mask) stay zero (SparseGPT-style joint use).
"""
from __future__ import annotations

import torch

from hardy.formats.quantized import QuantSpec, QuantTensor, dequantize_with, group_params, quantize_with


def damped_inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹ with λ = damp · mean(diag H); more damping if needed."""
    # in float64, factored in place: one n² matrix at a time (an 8B down projection's n = 14336 makes
    # it 1.6 GB; H + λ·eye(n) and a name per factor held six)
    mean_diag = torch.diag(h).double().mean().item() or 1.0
    for attempt in range(6):
        lam = damp * (10 ** attempt) * mean_diag
        m = h.to(torch.float64, copy=True)
        m.diagonal().add_(lam)
        try:
            torch.linalg.cholesky(m, out=m)
            torch.cholesky_inverse(m, out=m)
            torch.linalg.cholesky(m, upper=True, out=m)
            return m.float()
        except torch.linalg.LinAlgError:
            continue
    raise RuntimeError("GPTQ: the calibration Hessian is not positive definite even with heavy damping")


def gptq(w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, block_size: int = 128, damp: float = 0.01,
         act_order: bool = True, mask: torch.Tensor | None = None) -> QuantTensor:
    """Quantize w [out, in] given H [in, in]. `mask` (bool, True = keep) holds pruned weights at zero."""
    w = w.float().clone()
    out_features, cols = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # columns never activated: any value works, zero is cheapest
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if mask is not None:
        w = w * mask
    group = spec.group_width(cols)
    groups = spec.groups(cols)
    scale = torch.empty(out_features, groups, device=w.device)
    mins = None if spec.symmetric else torch.empty(out_features, groups, device=w.device)

    def set_group(g: int, weights: torch.Tensor) -> None:
        s, m = group_params(weights, spec)
        scale[:, g] = s[:, 0]
        if mins is not None:
            mins[:, g] = m[:, 0]

    if act_order:
        for g in range(groups):
            set_group(g, w[:, g * group:(g + 1) * group])
        perm = torch.argsort(torch.diag(h), descending=True)
    else:
        perm = torch.arange(cols, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    keep = None if mask is None else mask[:, perm]
    hinv = damped_inverse_cholesky(h, damp)
    codes = torch.zeros(out_features, cols, device=w.device)
    order = perm.tolist()  # read once: a per-column read-back would stall a GPU thousands of times
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = order[i1 + i]
            g = col // group
            if not act_order and col % group == 0:
                set_group(g, torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :group])
            s = scale[:, g:g + 1]
            m = None if mins is None else mins[:, g:g + 1]
            column = w1[:, i:i + 1]
            code = quantize_with(column, s, m, spec)
            q = dequantize_with(code, s, m, spec.offset)
            if keep is not None:  # pruned: stays (as near as the grid allows to) zero
                k = keep[:, i1 + i:i1 + i + 1]
                zero = quantize_with(torch.zeros_like(column), s, m, spec)
                code = torch.where(k, code, zero)
                q = torch.where(k, q, dequantize_with(zero, s, m, spec.offset))
            codes[:, i1 + i] = code[:, 0]
            e = (column[:, 0] - q[:, 0]) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inverse = torch.argsort(perm)
    codes = codes[:, inverse]
    return QuantTensor(codes=codes.to(spec.code_dtype), scale=scale.half(), mins=None if mins is None else mins.half(), spec=spec)
