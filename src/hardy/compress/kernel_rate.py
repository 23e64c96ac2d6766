"""The rate at which hardy's fused int4 decode kernel streams its weights, for `hardy probe` (the
planner's decode model reads it from the profile). Here, not in ops/, because it runs compress's
layers and kernels; the probe is handed this function by the command line."""
from __future__ import annotations

import torch

from hardy.compress import kernels
from hardy.compress.qlinear import QuantLinear
from hardy.formats.quantized import QuantSpec, QuantTensor
from hardy.ops.kernel_probe import best_time

MiB = 1 << 20


def measure_quant_gemv(device: torch.device, quick: bool) -> dict | None:
    """Rate at which hardy's fused int4 decode kernel (hardy.compress.kernels; symmetric int4 g32, a
    GGUF Q4_0 file's layout) reads its weights at batch 1, on a 4096-wide matrix of >= 64 MiB (DRAM,
    as a real model's layers are). None off the CPU or where the kernels are not built."""
    if device.type != "cpu":
        return None
    if kernels.load() is None:
        return None
    width, spec = 4096, QuantSpec(4, 32, True)
    nbytes = width // 2 + 2 * width // 32  # per row: the codes and one fp16 scale per 32
    rows = -(-(64 * MiB) // nbytes) // 8 * 8 + 8
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (rows, width), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(rows, width // 32, generator=gen) * 1e-2 + 1e-3).half()
    layer = QuantLinear(QuantTensor(codes=codes, scale=scale, mins=None, spec=spec))
    del codes
    kernels.prepare(layer)
    x = torch.randn(1, width)
    seconds = best_time(lambda: layer(x), device, 0.05 if quick else 0.2)
    return {"format": "int4 symmetric g32 (Q4_0)", "width": width, "bytes": rows * nbytes,
            "bandwidth": rows * nbytes / seconds}
