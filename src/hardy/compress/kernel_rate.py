"""The rates at which hardy's fused int4 decode kernels stream their weights, for `hardy probe` (the
planner's decode model reads them from the profile): a dense layer's matrix, and a mixture of experts'
grouped experts (small matrices, a few of many per token). Here, not in ops/, because it runs compress's
layers and kernels; the probe is handed this function by the command line."""
from __future__ import annotations

import itertools

import torch

from hardy.compress import kernels
from hardy.compress.qlinear import QuantLinear
from hardy.formats.quantized import QuantSpec, QuantTensor
from hardy.ops.kernel_probe import best_time, dram_bytes

MiB = 1 << 20


def measure_quant_gemv(device: torch.device, quick: bool) -> dict | None:
    """Rate at which hardy's fused int4 decode kernel (hardy.compress.kernels; symmetric int4 g32, a
    GGUF Q4_0 file's layout) reads its weights at batch 1, on matrices larger than the caches
    (hardy.ops.kernel_probe.dram_bytes: from DRAM, as a real model's layers are) of widths from a 1B
    model's to an 8B model's: narrower rows pay the per-row reduction on fewer bytes. The 4096-wide
    rate is the profile's figure. None off the CPU or where the kernels are not built."""
    if device.type != "cpu":
        return None
    if kernels.load() is None:
        return None
    gen = torch.Generator().manual_seed(0)
    by_width, nbytes = {}, 0
    for width in QUANT_WIDTHS:
        per_row = width // 2 + 2 * width // 32  # the codes and one fp16 scale per 32
        rows = -(-dram_bytes() // per_row) // 8 * 8 + 8
        layer = _random_q4_0(rows, width, gen)
        kernels.prepare(layer)
        x = torch.randn(1, width)
        nbytes = rows * per_row
        by_width[str(width)] = nbytes / best_time(lambda: layer(x), device, 0.05 if quick else 0.2)
        del layer
    return {"format": "int4 symmetric g32 (Q4_0)", "width": QUANT_WIDTHS[-1], "bytes": nbytes,
            "bandwidth": by_width[str(QUANT_WIDTHS[-1])], "bandwidth_by_width": by_width, **measure_expert_gemv(quick)}


QUANT_WIDTHS = (1024, 2048, 4096)


def _random_q4_0(rows: int, cols: int, gen: torch.Generator) -> QuantLinear:
    # 64 random rows repeated: the kernel's speed does not depend on the values, and drawing a
    # DRAM-sized matrix value by value would take longer than timing it
    codes = torch.randint(0, 16, (min(rows, 64), cols), dtype=torch.uint8, generator=gen).repeat(-(-rows // 64), 1)[:rows]
    scale = (torch.rand(min(rows, 64), cols // 32, generator=gen) * 1e-2 + 1e-3).half().repeat(-(-rows // 64), 1)[:rows]
    return QuantLinear(QuantTensor(codes=codes, scale=scale, mins=None, spec=QuantSpec(4, 32, True)))


# A Qwen3-30B-A3B layer's experts (hidden 2048, expert width 768, 8 of 128 per token), as many of them
# as hold more bytes than the caches (dram_bytes): a token's experts come from DRAM, as a real model's do
EXPERT_SHAPE = dict(dim=2048, ffn=768, top_k=8)


def measure_expert_gemv(quick: bool) -> dict:
    """Rate at which the grouped experts kernel (csrc/moe.cpp) reads a batch-1 token's active experts
    (gate, up and down, Q4_0) when each call routes to experts the last few calls did not touch: small
    matrices read a few at a time run below a large matrix's rate."""
    d, f, k = EXPERT_SHAPE["dim"], EXPERT_SHAPE["ffn"], EXPERT_SHAPE["top_k"]
    per_expert = 3 * d * f * 18 // 32  # Q4_0: 18 bytes per 32 weights, ~2.6 MiB
    n = max(32, -(-dram_bytes() // per_expert))
    gen = torch.Generator().manual_seed(1)
    experts = torch.nn.ModuleList(torch.nn.ModuleList([_random_q4_0(f, d, gen), _random_q4_0(f, d, gen),
                                                       _random_q4_0(d, f, gen)]) for _ in range(n))
    kernels.prepare(experts)
    grouped = kernels.experts_kernel(kernels.load(), [lin for trio in experts for lin in trio], gelu=False)
    order = torch.randperm(n, generator=gen)
    routes = [order[(i * k + torch.arange(k)) % n].reshape(1, k).contiguous() for i in range(n)]
    weights, x, calls = torch.full((1, k), 1.0 / k), torch.randn(1, d), itertools.count()

    def one_token():
        grouped(x, routes[next(calls) % n], weights)

    seconds = best_time(one_token, torch.device("cpu"), 0.05 if quick else 0.2)
    per_token = k * sum(t.numel() * t.element_size() for lin in experts[0] for t in (lin.qweight, lin.scales))
    return {"expert_shape": dict(EXPERT_SHAPE, experts=n), "expert_bytes": per_token,
            "expert_bandwidth": per_token / seconds}
