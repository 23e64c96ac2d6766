"""Each GGUF type's decode kernel on one matrix, as a native load holds it: random blocks of the type
(bench/big_cpu_model.py's) converted by the loader's own path, applied to one token, median of `--calls`
calls, `--repeats` rounds alternating the types; bytes held, time per call and the bytes per second it
streams, against this machine's DRAM read bandwidth. Llama-3.1-8B's gate/up (14336 x 4096) and down
(4096 x 14336) projections by default. Each call applies the next of several copies of the matrix
(`--stream-mb` of them in all, beyond the last-level cache), so the weights come from DRAM as in
decode; `--stream-mb 0` calls one copy, whose bytes then stay in cache: the kernel's compute rate.

    .venv/bin/python bench/gguf_kernel.py [--types Q4_0,Q4_K,Q5_K,Q6_K,Q8_0] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics

import gguf
import numpy as np
import torch

from big_cpu_model import random_blocks, read_bandwidth
from decode_common import median_s

from hardy.compress import kernels
from hardy.compress.qlinear import QuantLinear
from hardy.formats.gguf_quant import packed_from_gguf


class BlockTensor:
    """What the loader reads from a GGUF tensor: name, type, shape (columns first) and the block bytes."""

    def __init__(self, qtype: str, rows: int, cols: int, seed: int = 0):
        self.name, self.tensor_type = f"bench.{qtype}", gguf.GGMLQuantizationType[qtype]
        self.shape = np.array([cols, rows], dtype=np.uint64)
        self.data = random_blocks(np.random.default_rng(seed), rows, cols, qtype)  # what bench/big_cpu_model.py writes


def held(layer) -> int:
    return sum(t.numel() * t.element_size() for t in kernels.kernel_tensors(layer))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q5_K,Q6_K,Q8_0")
    ap.add_argument("--shapes", default="14336x4096,4096x14336")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-mb", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = kernels.load()
    if module is None:
        raise SystemExit("the kernels did not build")
    bandwidth = read_bandwidth(args.threads)
    print(f"DRAM read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); median of {args.calls} calls, "
          f"{args.repeats} alternating rounds, round-robin over {args.stream_mb} MB of copies")
    print(f"| matrix | type | bytes held | per 256 weights | time per call, ms (median [min, max] of rounds) | GB/s |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.split("x"))
        layers = {}
        for qtype in args.types.split(","):
            copies = []
            while not copies or len(copies) * held(copies[0]) < args.stream_mb * 1e6:
                layer = QuantLinear(packed_from_gguf(BlockTensor(qtype, rows, cols, seed=len(copies)), converter=module))
                kernels.prepare(torch.nn.Sequential(layer))
                assert layer.kernel is not None, qtype
                copies.append(layer)
            layers[qtype] = copies
        x = torch.randn(1, cols)
        times = {q: [] for q in layers}
        for _ in range(args.repeats):
            for qtype, copies in layers.items():
                turn = iter(range(10 ** 9))
                times[qtype].append(median_s(lambda: copies[next(turn) % len(copies)].kernel(x), args.calls))
        for qtype, copies in layers.items():
            nbytes = held(copies[0])
            t = statistics.median(times[qtype])
            print(f"| {rows} x {cols} | {qtype} | {nbytes / 1e6:.1f} MB | {nbytes * 256 / (rows * cols):.0f} B | "
                  f"{t * 1e3:.3f} [{min(times[qtype]) * 1e3:.3f}, {max(times[qtype]) * 1e3:.3f}] | "
                  f"{nbytes / t / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
