"""Where the fused int4 kernel stops beating the prefill path: one quantized linear (int4 g32, the
symmetric Q4_0 grid) applied to T tokens by the kernel (int8 activations, the weights streamed once)
and by the slab path (C++ dequantization of 4-MB slabs + bf16 or fp32 GEMMs), median of 7 calls each.
hardy.compress.qlinear.FUSED_MAX_TOKENS is set from this.

    .venv/bin/python bench/kernel_tokens.py
"""
from __future__ import annotations


import torch

from decode_common import median_s

from hardy.compress import kernels, qlinear
from hardy.compress.qlinear import QuantLinear
from hardy.formats.quantized import QuantSpec, rtn

SHAPES = [(14336, 4096), (4096, 4096), (1536, 576)]  # Llama-3.1-8B's gate/up and q, SmolLM2's gate/up


def main() -> None:
    torch.set_num_threads(2)
    if kernels.load() is None:
        raise SystemExit("the kernels did not build")
    dtype = torch.bfloat16 if torch.backends.mkldnn.is_available() else torch.float32
    print(f"{'layer':>12} {'T':>4} {'kernel ms':>10} {'slab ms':>8} {'slab / kernel':>14}   (slab GEMMs in {dtype})")
    for rows, cols in SHAPES:
        layer = QuantLinear(rtn(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02,
                                QuantSpec(4, 32, True)))
        kernels.prepare(torch.nn.Sequential(layer))
        qlinear.set_prefill_dtype(layer, dtype)
        for tokens in (1, 4, 8, 16, 32, 64):
            x = torch.randn(tokens, cols)
            k, s = median_s(lambda: layer.kernel(x)), median_s(lambda: layer._slab_forward(x))
            print(f"{rows:>6}x{cols:<5} {tokens:>4} {k * 1e3:10.2f} {s * 1e3:8.2f} {s / k:13.2f}x", flush=True)


if __name__ == "__main__":
    main()
