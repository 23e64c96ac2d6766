"""Cross-entropy fused with the LM head, computed in row chunks.

The full logits of a 49k-vocabulary model are the largest activation in training (batch 4 x 256
x 49,152 fp32 = 201 MB, plus their softmax gradient). Here each chunk's logits live only
briefly. In fp32 and bf16 the forward pass also computes the gradients w.r.t. the hidden states
and the head weight (softmax - one_hot), so backward is a multiply and nothing is recomputed.

fp16 is different: its range ends at 6e-8, and a softmax gradient divided by the token count
underflows there unless the loss scale multiplies it first — and the loss scale is only known in
backward (it arrives as the incoming gradient). So in fp16 the forward computes the loss alone and
backward recomputes each chunk's logits, scaling the gradient before anything is rounded to fp16:
the same numbers autograd would give an unfused head, at one extra GEMM over the vocabulary.
"""
from __future__ import annotations

import torch

_MAX_CHUNK_ELEMENTS = 1 << 24  # 64 MB of fp32 logits per chunk


def _chunks(n: int, vocab: int):
    n_chunks = -(-n // max(1, _MAX_CHUNK_ELEMENTS // vocab))
    chunk = -(-n // n_chunks)  # equal chunks: 1024 rows -> 3 x 342, not 3 x 341 + 1
    return range(0, n, chunk), chunk


def _add_chunk_gradients(g, h, w, grad_h_rows, grad_w) -> None:
    """One chunk's share of the gradients from its logit gradient g: rows of d/dhidden, and d/dweight
    accumulated in fp32."""
    torch.mm(g, w, out=grad_h_rows)
    if g.dtype == grad_w.dtype:
        grad_w.addmm_(g.t(), h)  # in place: no 113 MB temporary per chunk for SmolLM2
    else:
        grad_w += (g.t() @ h).float()


def _softmax_minus_one_hot(logp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    g = logp.exp_()  # softmax, in place; d(sum loss)/d(logits) = softmax - one_hot
    g[torch.arange(len(t), device=t.device), t] -= 1.0
    return g


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets):
        n, vocab = hidden.shape[0], weight.shape[0]
        starts, chunk = _chunks(n, vocab)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        deferred = need_grad and hidden.dtype == torch.float16
        early = need_grad and not deferred
        w = weight.to(hidden.dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if early else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if early else None
        for start in starts:
            h = hidden[start:start + chunk]
            t = targets[start:start + chunk]
            logp = torch.log_softmax((h @ w.t()).float(), dim=-1)  # one fused pass over the chunk
            total -= logp.gather(1, t[:, None]).sum()
            if early:
                g = _softmax_minus_one_hot(logp, t).to(hidden.dtype)
                _add_chunk_gradients(g, h, w, grad_h[start:start + chunk], grad_w)
        ctx.deferred = deferred
        if early:  # the 1/n of the mean, applied to the small results rather than the logits
            grad_h /= n
            grad_w /= n
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        elif deferred:
            ctx.save_for_backward(hidden, weight, targets)
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.deferred:
            hidden, weight, targets = ctx.saved_tensors
            grad_h, grad_w = _scaled_gradients(hidden, weight, targets, grad_out)
            return grad_h, grad_w, None
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None


def _scaled_gradients(hidden, weight, targets, grad_out):
    """d(grad_out · mean CE)/d(hidden, weight), the factor grad_out / n applied in fp32 to each chunk's
    softmax gradient before it is rounded to the compute dtype."""
    n, vocab = hidden.shape[0], weight.shape[0]
    starts, chunk = _chunks(n, vocab)
    w = weight.to(hidden.dtype)
    factor = grad_out.float() / n
    grad_h = torch.empty_like(hidden)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in starts:
        h = hidden[start:start + chunk]
        t = targets[start:start + chunk]
        logp = torch.log_softmax((h @ w.t()).float(), dim=-1)
        g = (_softmax_minus_one_hot(logp, t) * factor).to(hidden.dtype)
        _add_chunk_gradients(g, h, w, grad_h[start:start + chunk], grad_w)
    return grad_h, grad_w.to(weight.dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """mean CE(hidden @ weight.T, targets) for hidden [N, d], weight [V, d], targets [N]."""
    return _LinearCrossEntropy.apply(hidden, weight, targets)
