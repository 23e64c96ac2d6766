"""Prefill's slab size: one quantized linear (int4 g32, the symmetric Q4_0 grid) applied to a prompt of T
tokens by QuantLinear's slab path — the C++ dequantization of `rows` rows at a time, one GEMM per slab —
for several slab heights, in the GEMM dtype inference uses on this CPU (bf16 where it has native bf16).
The heights run round-robin, `--reps` rounds; each cell is the median effective rate 2·N·K·T / time, and
the dequantization alone (the whole matrix, no GEMM) is timed beside them as the floor's other half.
hardy.compress.qlinear.PREFILL_BF16_ROWS is set from this.

    .venv/bin/python bench/prefill_slabs.py --tokens 512 --reps 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hardy.compress import kernels, qlinear
from hardy.compress.qlinear import QuantLinear
from hardy.formats.quantized import QuantSpec, rtn
from hardy.ops.matmul_probe import has_fast_bf16

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)]  # Llama-3.1-8B's q/o, gate/up, down, k/v
HEIGHTS = (256, 512, 768, 1024, 1536, 2048)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if kernels.load() is None:
        raise SystemExit("the kernels did not build")
    dtype = torch.bfloat16 if has_fast_bf16(torch.device("cpu")) else torch.float32
    print(f"{torch.get_num_threads()} threads, GEMMs in {dtype}, T = {args.tokens}; effective TFLOP/s, median of "
          f"{args.reps} (dequant: Gweights/s)")
    print(f"{'N x K':>12} {'dequant':>8} " + " ".join(f"{h:>6}" for h in HEIGHTS))
    for n, k in SHAPES:
        layer = QuantLinear(rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02,
                                QuantSpec(4, 32, True)))
        kernels.prepare(torch.nn.Sequential(layer))
        qlinear.set_prefill_dtype(layer, dtype)
        x = torch.randn(1, args.tokens, k)
        slab = torch.empty(n, k, dtype=dtype)
        times: dict[object, list[float]] = {h: [] for h in (*HEIGHTS, "dequant")}
        for rep in range(args.reps + 1):  # the first round warms oneDNN's primitive cache; not counted
            for h in HEIGHTS:
                qlinear.PREFILL_BF16_ROWS = h
                qlinear.PREFILL_SLAB_BYTES = h * k * slab.element_size()
                t = timed(lambda: layer(x))
                if rep:
                    times[h].append(t)
            t = timed(lambda: layer.kernel.dequant_range(0, slab))
            if rep:
                times["dequant"].append(t)
        rate = {h: 2 * n * k * args.tokens / statistics.median(times[h]) / 1e12 for h in HEIGHTS}
        print(f"{f'{n} x {k}':>12} {n * k / statistics.median(times['dequant']) / 1e9:8.2f} "
              + " ".join(f"{rate[h]:6.2f}" for h in HEIGHTS), flush=True)


if __name__ == "__main__":
    main()
