"""Pruning: magnitude, Wanda (Sun et al. 2023) and SparseGPT (Frantar & Alistarh 2023), unstructured
at a sparsity fraction or N:M semi-structured (2:4: in every 4 consecutive input weights, 2 are zero).

  magnitude  drop the smallest |W| of the whole layer (N:M: of each group of M)
  Wanda      drop the smallest |W_ij|·‖X_j‖ within each output row (N:M: each group of M) — no update
  SparseGPT  choose the mask block by block from w²/[H⁻¹]²_jj (the OBS saliency) and update the
             remaining weights to compensate, with the same inverse-Hessian machinery as GPTQ
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hardy.compress.gptq import damped_inverse_cholesky
from hardy.errors import HardyError


@dataclass(frozen=True)
class Sparsity:
    fraction: float = 0.0  # unstructured
    n: int = 0  # N:M — n zeros in every m
    m: int = 0

    @classmethod
    def parse(cls, text: str) -> "Sparsity":
        try:
            if ":" in text:
                n, m = (int(v) for v in text.split(":"))
                if not 0 < n < m:
                    raise ValueError
                return cls(n=m - n, m=m)  # "2:4" = keep 2 of 4 → 2 zeros of 4
            fraction = float(text)
            if not 0 < fraction < 1:
                raise ValueError
            return cls(fraction=fraction)
        except ValueError:
            raise HardyError(f"--sparsity must be a fraction in (0, 1) or N:M like 2:4 (got {text!r})") from None

    @property
    def structured(self) -> bool:
        return self.m > 0

    def label(self) -> str:
        return f"{self.m - self.n}:{self.m}" if self.structured else f"{self.fraction:.0%}"


def _mask_from_scores(scores: torch.Tensor, sparsity: Sparsity, per_row: bool) -> torch.Tensor:
    """True = keep. The lowest-scoring weights are dropped."""
    out, cols = scores.shape
    if sparsity.structured:
        if cols % sparsity.m:
            raise HardyError(f"{sparsity.label()} sparsity needs the input width ({cols}) to be a multiple of {sparsity.m}")
        groups = scores.reshape(out, cols // sparsity.m, sparsity.m)
        drop = torch.topk(groups, sparsity.n, dim=-1, largest=False).indices
        mask = torch.ones_like(groups, dtype=torch.bool).scatter_(-1, drop, False)
        return mask.reshape(out, cols)
    if per_row:
        k = int(cols * sparsity.fraction)
        drop = torch.topk(scores, k, dim=1, largest=False).indices
        return torch.ones_like(scores, dtype=torch.bool).scatter_(1, drop, False)
    k = int(scores.numel() * sparsity.fraction)
    threshold = torch.kthvalue(scores.flatten(), k).values if k else scores.min() - 1
    return scores > threshold


def magnitude(w: torch.Tensor, sparsity: Sparsity) -> tuple[torch.Tensor, torch.Tensor]:
    mask = _mask_from_scores(w.abs().float(), sparsity, per_row=False)
    return w * mask, mask


def wanda(w: torch.Tensor, input_sq_norms: torch.Tensor, sparsity: Sparsity) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_sq_norms`: Σ x_j² over calibration tokens for each input column j."""
    scores = w.abs().float() * input_sq_norms.float().clamp_min(0).sqrt()[None, :]
    mask = _mask_from_scores(scores, sparsity, per_row=True)
    return w * mask, mask


def sparsegpt(w: torch.Tensor, hessian: torch.Tensor, sparsity: Sparsity, block_size: int = 128,
              damp: float = 0.01, mask_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`mask_block`: columns whose unstructured mask is chosen together (per output row, from the
    weights as updated so far); default the whole row, which keeps each row's sparsity where its
    salient weights are (with 128 every block of columns is forced to the same sparsity)."""
    w = w.float().clone()
    out_features, cols = w.shape
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv = damped_inverse_cholesky(h, damp)
    mask = torch.ones_like(w, dtype=torch.bool)
    mask_block = mask_block or cols
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        diag = torch.diag(hinv1)[None, :]
        if not sparsity.structured and i1 % mask_block == 0:  # OBS saliency w² / [H⁻¹]²_jj per output row
            m2 = min(i1 + mask_block, cols)
            saliency = w[:, i1:m2] ** 2 / torch.diag(hinv)[None, i1:m2] ** 2
            k = int(saliency.shape[1] * sparsity.fraction)
            drop = torch.topk(saliency, k, dim=1, largest=False).indices
            mask[:, i1:m2] = torch.ones_like(saliency, dtype=torch.bool).scatter_(1, drop, False)
        mask1 = mask[:, i1:i2].clone()
        for i in range(i2 - i1):
            if sparsity.structured and i % sparsity.m == 0:  # choose each N:M group as it is reached
                group = w1[:, i:i + sparsity.m] ** 2 / diag[:, i:i + sparsity.m] ** 2
                drop = torch.topk(group, sparsity.n, dim=1, largest=False).indices
                mask1[:, i:i + sparsity.m].scatter_(1, drop, False)
            column = w1[:, i]
            q = torch.where(mask1[:, i], column, torch.zeros_like(column))
            e = (column - q) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            w1[:, i] = q
            err1[:, i] = e
        w[:, i1:i2] = w1
        mask[:, i1:i2] = mask1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return w * mask, mask
