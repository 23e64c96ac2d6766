"""The mixture-of-experts block that stands where a dense block has its MLP: a router picks `top_k` of
`n_experts` gated MLPs for each token and mixes their outputs by the router's weights; Qwen2-MoE adds
a shared expert every token goes through, scaled by a sigmoid gate.

The router is a strategy (`ROUTERS`): softmax over every expert, then the top k, renormalized or not
(Mixtral always renormalizes; Qwen3-MoE and Qwen2-MoE follow `norm_topk_prob`). DeepSeek-V3's
sigmoid scores with a selection bias and expert groups, and gpt-oss's softmax over the chosen k, are
further strategies of the same signature (docs/moe.md says what else each needs).

Experts are separate gated MLPs (`experts.{e}.w1/w3/w2`), so every per-linear tool — quantization,
calibration, tensor parallelism — applies to them unchanged; the forward groups tokens by expert so
each active expert runs once on all of its tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hardy.model.config import ModelConfig, MoEConfig


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] fp32, experts [tokens, k]): softmax over all experts, the k largest, divided
    by their sum if `normalize`. Ties go to the lower expert index (a stable sort), so a route is the
    same on every machine and in every batch."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


ROUTERS = {"softmax_topk": softmax_topk}


def route(cfg: MoEConfig, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ROUTERS[cfg.router](logits, cfg.top_k, cfg.norm_topk_prob)


class GatedMLP(nn.Module):
    """One expert (or the shared expert): w2(act(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int, act: str):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))


def group_by_expert(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The (token, slot) pairs of a routing [tokens, k] ordered by expert (flat indices into it), and how
    many each expert received: expert e's pairs are order[sum(counts[:e]) : sum(counts[:e+1])]."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()  # one host read per layer
    return order, counts


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.router = nn.Linear(cfg.dim, moe.n_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(cfg.dim, moe.ffn_dim, cfg.mlp_act) for _ in range(moe.n_experts))
        self.shared = GatedMLP(cfg.dim, moe.shared_ffn_dim, cfg.mlp_act) if moe.shared_ffn_dim else None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if moe.shared_ffn_dim and moe.shared_gate else None
        # (x, weights, experts) -> the experts' weighted sum in one call: attached from outside where the
        # experts are quantized with compiled kernels (hardy.compress.kernels.grouped_experts)
        self.grouped = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts = route(self.moe, self.router(flat))
        if self.grouped is not None and flat.dtype == torch.float32:
            out = self.grouped(flat.contiguous(), weights.contiguous(), experts.contiguous())
        else:
            out = self.mix(flat, weights.to(flat.dtype), experts)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.reshape(shape)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(token): every active expert runs once, on
        all of its tokens together."""
        k = experts.shape[1]
        order, counts = group_by_expert(experts, self.moe.n_experts)
        out = torch.zeros_like(x)
        begin = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[begin:begin + n]
            tokens = pairs // k
            y = self.experts[e](x[tokens]) * weights.flatten()[pairs, None]
            out.index_add_(0, tokens, y)
            begin += n
        return out
