"""Cross-entropy fused with the LM head, computed in row chunks.

The full logits of a 49k-vocabulary model are the largest activation in training (batch 4 x 256
x 49,152 fp32 = 201 MB, plus their softmax gradient). Here each chunk's logits live only
briefly: the forward pass also computes the gradients w.r.t. the hidden states and the head
weight (softmax - one_hot), so backward is a multiply and nothing is recomputed.
"""
from __future__ import annotations

import torch

_MAX_CHUNK_ELEMENTS = 1 << 24  # 64 MB of fp32 logits per chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets):
        n, vocab = hidden.shape[0], weight.shape[0]
        n_chunks = -(-n // max(1, _MAX_CHUNK_ELEMENTS // vocab))
        chunk = -(-n // n_chunks)  # equal chunks: 1024 rows -> 3 x 342, not 3 x 341 + 1
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            t = targets[start:start + chunk]
            logp = torch.log_softmax((h @ w.t()).float(), dim=-1)  # one fused pass over the chunk
            total -= logp.gather(1, t[:, None]).sum()
            if need_grad:
                g = logp.exp_()  # softmax, in place; d(sum loss)/d(logits) = softmax - one_hot
                g[torch.arange(len(t), device=t.device), t] -= 1.0
                g = g.to(hidden.dtype)
                torch.mm(g, w, out=grad_h[start:start + chunk])
                if g.dtype == grad_w.dtype:
                    grad_w.addmm_(g.t(), h)  # in place: no 113 MB temporary per chunk for SmolLM2
                else:
                    grad_w += (g.t() @ h).float()
        if need_grad:  # the 1/n of the mean, applied to the small results rather than the logits
            grad_h /= n
            grad_w /= n
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean CE(hidden @ weight.T, targets) for hidden [N, d], weight [V, d], targets [N]."""
    return _LinearCrossEntropy.apply(hidden, weight, targets)
