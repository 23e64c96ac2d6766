"""How fast the fused kernels stream int8 weights against int4 ones, per byte: one quantized linear
(RTN of random weights) applied to one token, median of 25 calls, at SmolLM2's LM-head shape and
Llama-3.1-8B's gate and down projections. Decode reads every weight once per token, so a kernel that
streams int8 at int4's bytes per second makes an int8 layer cost only its extra bytes (an int8 head
or embedding table, GGUF Q8_0 and Q6_K tensors).

    .venv/bin/python bench/int8_kernel.py [--threads 2]
"""
from __future__ import annotations

import argparse

import torch

from decode_common import median_s

from hardy.compress import kernels
from hardy.compress.qlinear import QuantLinear
from hardy.formats.quantized import QuantSpec, rtn

SHAPES = [(49152, 576), (14336, 4096), (4096, 14336)]  # SmolLM2's head; 8B gate/up; 8B down
SPECS = {"int8 g32": QuantSpec(8, 32), "int4 g32": QuantSpec(4, 32), "int4 g32 sym": QuantSpec(4, 32, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if kernels.load() is None:
        raise SystemExit("the kernels did not build")
    print(f"{'layer':>12} {'format':>13} {'us':>8} {'MB':>6} {'GB/s':>6}   ({args.threads} threads, 1 token)")
    for rows, cols in SHAPES:
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)) * 0.02
        rate = {}
        for name, spec in SPECS.items():
            layer = QuantLinear(rtn(w, spec))
            kernels.prepare(torch.nn.Sequential(layer))
            nbytes = sum(t.numel() * t.element_size() for t in kernels.kernel_tensors(layer))
            x = torch.randn(1, cols)
            t = median_s(lambda: layer.kernel(x), 25)
            rate[name] = nbytes / t / 1e9
            print(f"{rows:>6}x{cols:<5} {name:>13} {t * 1e6:8.1f} {nbytes / 1e6:6.1f} {rate[name]:6.1f}", flush=True)
        print(f"{'':>12} int8 / int4 bytes per second: {rate['int8 g32'] / rate['int4 g32']:.2f}x")


if __name__ == "__main__":
    main()
