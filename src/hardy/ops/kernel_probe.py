"""Training- and decode-shaped kernel rates for `hardy probe`: the three GEMMs of a linear layer by
model width, causal attention (SDPA) forward + backward by head size, the eager elementwise operators of a
real Llama layer's forward + backward (DRAM-resident activations), and batch-1 GEMV weight
streaming by width.

Each is measured the way training or decoding meets it, not at its best case: on a CPU a 64-wide
GEMM runs at a fraction of a square one, flash attention with 16-dim heads at a sixth of the GEMM
rate, and an elementwise operator whose operands come from DRAM (as activations do) at a fifth of
its cache-resident rate. The planner (hardy.plan.timing) interpolates these tables at the model's
own width and head size.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hardy.model.config import ModelConfig
from hardy.model.transformer import Rotary, TransformerBlock, rope_tables

MiB = 1 << 20


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache the OS reports (Linux sysfs), 0 where it reports none."""
    sizes = []
    for entry in root.glob("index*/size"):
        text = entry.read_text().strip().upper()
        try:
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except ValueError:
            continue
    return max(sizes, default=0)


def dram_bytes(floor: int = 256 * MiB, cap: int = 1 << 30, cache: int | None = None) -> int:
    """Bytes a decode-rate measurement streams so that they come from DRAM, as a real model's weights
    do: twice the last-level cache, at least `floor`, at most `cap`. A fixed 64 MiB did not: on a Xeon
    with a 300 MiB L3 it measured ~54 GB/s where 2 threads read DRAM at ~29 (BENCHMARKS.md)."""
    cache = last_level_cache_bytes() if cache is None else cache
    return int(min(cap, max(floor, 2 * cache)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, min_time: float) -> float:
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < min_time and reps < 50):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def measure_training_gemms(device: torch.device, best_flops: float, quick: bool) -> dict:
    """FLOP/s of the three GEMMs of a linear layer in training — y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x —
    at (tokens, width, ~2.7 x width) shapes from a 64-wide toy model to a 7B one, in fp32. The ratio
    to the best square matmul, by width, is what the planner applies to a model's GEMMs; the widest
    shape's ratio is the profile's overall GEMM efficiency (large layers)."""
    if device.type == "cpu":
        shapes = [(4096, 64, 176), (2048, 256, 688), (1024, 576, 1536), (512, 1536, 4096)]
    else:
        shapes = [(8192, 512, 1408), (8192, 2048, 5632), (8192, 4096, 14336)]
    rows = []
    for tokens, d_in, d_out in shapes:
        x = torch.randn(tokens, d_in, device=device)
        w = torch.randn(d_out, d_in, device=device)
        dy = torch.randn(tokens, d_out, device=device)
        seconds = sum(best_time(fn, device, 0.05 if quick else 0.2) for fn in
                      (lambda: x @ w.t(), lambda: dy @ w, lambda: dy.t() @ x))
        flops = 3 * 2 * tokens * d_in * d_out / seconds
        rows.append({"shape": [tokens, d_in, d_out], "seconds": seconds, "flops": flops,
                     "efficiency": min(1.0, flops / best_flops)})
    return {"shapes": rows, "flops": rows[-1]["flops"], "efficiency": rows[-1]["efficiency"],
            "efficiency_by_width": {str(r["shape"][1]): r["efficiency"] for r in rows}}


class GemmTimer(TorchDispatchMode):
    """Times every matrix multiply that runs under it (a synchronize around each) and counts its
    FLOPs from the operand shapes: what a real layer's GEMMs achieve — all of its shapes, the
    transposed operands of the backward pass — rather than one benchmark shape's."""

    OPS = {"mm", "addmm", "bmm", "linear"}  # without autograd (inference) a linear arrives whole

    def __init__(self, device: torch.device):
        super().__init__()
        self.device, self.flops, self.seconds = device, 0.0, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name not in self.OPS:
            return func(*args, **kwargs)
        sync(self.device)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        sync(self.device)
        self.seconds += time.perf_counter() - t0
        a = args[1] if name == "addmm" else args[0]
        k = a.shape[-1]
        self.flops += 2 * out.numel() * k
        return out


def measure_layer_gemms(device: torch.device, best_flops: float, quick: bool,
                        dtype: torch.dtype = torch.float32, forward_only: bool = False) -> dict:
    """FLOP/s of the GEMMs of a real hardy Llama block, forward + backward, by model width (q/k/v/o
    projections, SwiGLU, their gradients), at the token counts training uses, in `dtype` (fp32 on a
    CPU, bf16 on a GPU: what each trains in), against `best_flops` of that dtype; the median of a few
    runs (a shared machine's bursts would flatter a best-of). The planner applies these, by width,
    to a model's layers and LM head. `forward_only`: the inference forward's projections alone (no
    gradients): what prefill and re-ranking run, apart from training's mix of shapes."""
    if device.type == "cpu":
        shapes = [(4096, 64, 176, 4), (2048, 256, 688, 8), (1024, 576, 1536, 8), (512, 1536, 4096, 24)]
    else:
        shapes = [(8192, 512, 1408, 8), (8192, 2048, 5632, 16), (8192, 4096, 14336, 32)]
    rows = {}
    for tokens, dim, ffn, heads in shapes:
        seq = min(256, tokens) if device.type == "cpu" else 2048
        cfg = ModelConfig(vocab_size=256, dim=dim, n_layers=1, n_heads=heads, n_kv_heads=max(1, heads // 2),
                          ffn_dim=ffn, max_seq_len=seq, name="probe")
        block = TransformerBlock(cfg).to(device=device, dtype=dtype)
        x = torch.randn(tokens // seq, seq, dim, device=device, dtype=dtype)
        rope = Rotary.shared(*(t.to(device=device, dtype=dtype) for t in rope_tables(cfg, seq)))
        rates = []
        for i in range(3 if quick else 5):
            timer = GemmTimer(device)
            if forward_only:
                with torch.no_grad(), timer:
                    block(x, rope)
            else:
                xi = x.detach().requires_grad_(True)
                block.zero_grad(set_to_none=True)
                with timer:
                    block(xi, rope).sum().backward()
            if i:  # the first run warms the allocator and kernel selection
                rates.append(timer.flops / timer.seconds)
        rate = statistics.median(rates)
        rows[str(dim)] = {"tokens": tokens, "ffn_dim": ffn, "heads": heads, "flops": rate,
                          "efficiency": min(1.0, rate / best_flops)}
    return {"dtype": str(dtype).removeprefix("torch."), "by_width": rows,
            "efficiency_by_width": {w: r["efficiency"] for w, r in rows.items()}}


def measure_attention(device: torch.device, best_flops: float, quick: bool) -> dict:
    """FLOP/s of causal scaled-dot-product attention, forward + backward, by head size, counted as
    the planner counts it (Q·Kᵀ and P·V over the unmasked half: 3 x 2·s²·d per head)."""
    seq = 256 if device.type == "cpu" else 2048
    elements = (1 << 21) if device.type == "cpu" else (1 << 25)  # of q: batch x heads x seq x head
    head_dims = (16, 32, 64, 128)
    rows = {}
    for hd in head_dims:
        bh = max(1, elements // (seq * hd))
        q, k, v = (torch.randn(1, bh, seq, hd, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, bh, seq, hd, device=device)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

        seconds = best_time(step, device, 0.05 if quick else 0.2)
        flops = 3 * 2 * bh * seq * seq * hd / seconds
        rows[str(hd)] = {"seconds": seconds, "flops": flops, "efficiency": min(1.0, flops / best_flops)}
    return {"seq": seq, "by_head_dim": rows,
            "efficiency_by_head_dim": {h: r["efficiency"] for h, r in rows.items()}}


# Operators that are not elementwise traffic: GEMMs and attention (timed by their own probes) and
# views (no data moves).
_COMPUTE_OPS = {"mm", "bmm", "addmm", "addmm_", "baddbmm", "linear", "matmul",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"}
_VIEW_OPS = {"view", "_unsafe_view", "transpose", "t", "expand", "slice", "select", "unsqueeze", "squeeze", "alias",
             "permute", "detach", "as_strided", "split", "split_with_sizes", "unbind", "_reshape_alias", "reshape",
             "empty", "empty_like", "empty_strided", "lift_fresh"}


class ElementwiseTraffic(TorchDispatchMode):
    """Counts the bytes every non-GEMM, non-view operator reads and writes (inputs + outputs) and,
    with `timed`, the seconds those operators take — what eager norms, RoPE, activations, residuals,
    loss and gradient accumulation cost. Used by the probe and to check the planner's byte count."""

    def __init__(self, device: torch.device | None = None, timed: bool = False):
        super().__init__()
        self.device, self.timed = device, timed
        self.bytes = self.ops = 0
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in _VIEW_OPS or name in _COMPUTE_OPS:
            return func(*args, **kwargs)
        if self.timed:
            sync(self.device)
            t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if self.timed:
            sync(self.device)
            self.seconds += time.perf_counter() - t0
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.ops += 1
        return out


def layer_traffic(block: torch.nn.Module, x: torch.Tensor, rope: Rotary,
                  device: torch.device | None = None, timed: bool = False) -> ElementwiseTraffic:
    """One forward + backward of a transformer block under an `ElementwiseTraffic` counter."""
    x = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)  # a step's first backward writes gradients, it does not add them
    with ElementwiseTraffic(device, timed) as traffic:
        block(x, rope).sum().backward()
    return traffic


def measure_elementwise(device: torch.device, quick: bool) -> dict:
    """Bytes/s of the elementwise operators of a real training layer — a hardy Llama block, forward
    and backward, at a size whose activations live in DRAM — timing only those operators (GEMMs and
    attention have their own probes). On a CPU this is a fraction of the copy bandwidth: broadcasts,
    concatenations, reductions and fresh output buffers, not streaming copies."""
    batch, seq = (8, 256) if device.type == "cpu" else (8, 2048)
    cfg = ModelConfig(vocab_size=256, dim=256 if device.type == "cpu" else 2048, n_layers=1, n_heads=8,
                      n_kv_heads=4, ffn_dim=688 if device.type == "cpu" else 5632, max_seq_len=seq, name="probe")
    block = TransformerBlock(cfg).to(device)
    x = torch.randn(batch, seq, cfg.dim, device=device)
    rope = Rotary.shared(*(t.to(device) for t in rope_tables(cfg, seq)))
    layer_traffic(block, x, rope)  # warm-up: allocator pools, kernel selection
    runs = [layer_traffic(block, x, rope, device, timed=True) for _ in range(2 if quick else 5)]
    rates = sorted(r.bytes / r.seconds for r in runs)
    return {"layer": {"dim": cfg.dim, "ffn_dim": cfg.ffn_dim, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                      "tokens": batch * seq}, "bytes": runs[0].bytes, "ops": runs[0].ops,
            "bandwidth": rates[len(rates) // 2]}


def measure_gemv(device: torch.device, quick: bool) -> dict:
    """Rate at which a batch-1 matrix-vector product (decoding one token) reads fp32 weights, at
    widths from a small model's to a 7B model's, from DRAM on a CPU (`dram_bytes`; a GPU's caches are
    far smaller than its 64 MiB): well below a streaming copy (measured 11-20 GB/s against a 30-48 GB/s
    copy here). The median is the profile's decode bandwidth."""
    widths = (576, 1536, 4096)
    rows, nbytes = {}, 0
    for width in widths:
        # more weights than the caches hold: decoding streams them from DRAM (cached ones would not)
        size = dram_bytes() if device.type == "cpu" else 64 * MiB
        w = torch.empty(max(width, size // (4 * width)), width, device=device).normal_()
        x = torch.randn(1, width, device=device)
        seconds = best_time(lambda: x @ w.t(), device, 0.05 if quick else 0.2)
        nbytes = w.numel() * w.element_size()
        rows[str(width)] = nbytes / seconds
    return {"bandwidth_by_width": rows, "bandwidth": statistics.median(rows.values()), "bytes": nbytes}
