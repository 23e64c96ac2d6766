"""Decode speed by context length (issue 40's long-context goal: decode at 8k context >= 0.7x decode at
512 on the 8B shape): one sequence whose paged KV cache already holds `ctx` positions, then greedy decode
steps (fused block stack + LM head, as `hardy generate` runs them) from position `ctx` on; contexts
alternate within each repetition.

The cache is filled with random keys and values instead of prefilling `ctx` real tokens (an 8k prefill of
the 8B shape takes ~8 minutes here): a decode step reads every cached position whatever its values, so its
time does not depend on them.

    .venv/bin/python bench/long_context.py --model /tmp/big/llama3.1-8b.Q4_0.gguf --contexts 512,8192 --reps 5
    .venv/bin/python bench/long_context.py --model smollm2-135m --contexts 512,4096,8192 --reps 5
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402
from results import record, slug  # noqa: E402


def fill_random(pool, generator: torch.Generator) -> None:
    """Every block of the pool: random keys and values of a realistic size, block by block (no float32
    copy of the whole cache)."""
    for i in range(pool.blocks.shape[0]):
        pool.blocks[i].copy_(torch.randn(pool.blocks[i].shape, generator=generator))


@torch.inference_mode()
def decode_tps(model, ctx: int, steps: int) -> float:
    from hardy.infer.fused_decode import decode_hidden

    token = torch.tensor([[1]])
    t0 = time.perf_counter()
    for i in range(steps):
        h = decode_hidden(model, token, ctx + i)
        token = model.logits(h[:, -1]).argmax(-1, keepdim=True)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/big/llama3.1-8b.Q4_0.gguf")
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per context and repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="bf16", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--record", action="store_true", help="write each context's ratio to bench/results/ "
                    "(BENCHMARKS.md's table)")
    args = ap.parse_args()
    from hardy.infer.fused_decode import fused_blocks
    from hardy.infer.kv import KV_DTYPES, PagedKVCache
    from hardy.loading.load import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model, gguf="native").model
    if fused_blocks(model) is None:
        raise SystemExit("this model does not run on the fused decode stack")
    contexts = [int(c) for c in args.contexts.split(",")]
    longest = max(contexts) + args.steps + 1
    cache = PagedKVCache(model, 1, longest, KV_DTYPES[args.kv])
    cache.pool.reserve(0, longest)
    fill_random(cache.pool, torch.Generator().manual_seed(0))
    decode_tps(model, contexts[0], 2)  # warm-up: weights paged in, kernels built
    samples = {c: [] for c in contexts}
    for rep in range(args.reps):
        for c in contexts if rep % 2 == 0 else reversed(contexts):
            samples[c].append(decode_tps(model, c, args.steps))
        print(f"rep {rep + 1}: " + "  ".join(f"ctx {c} {samples[c][-1]:.2f}" for c in contexts), flush=True)
    print(f"\n{args.model}, KV {args.kv}, {args.steps} steps per context, {args.threads} threads, {cpu_line()}")
    print("| context | decode tokens/s, median [95% interval] | / first context, per repetition |\n|---|---|---|")
    base = contexts[0]
    for c in contexts:
        ratio = median_ci([a / b for a, b in zip(samples[c], samples[base])])
        print(f"| {c} | {fmt(*median_ci(samples[c]), digits=2)} | {fmt(*ratio, digits=2)} |")
        if args.record and c != base:
            record(f"long-context-{slug(args.model)}-{c}", issue=40,
                   goal=f"Decode at {c:,} positions of context / at {base:,}, {Path(args.model).name}, KV {args.kv}",
                   target=(">=", 0.7) if (c, base) == (8192, 512) else None,
                   figure=f"{median_ci(samples[c])[0]:.2f} tok/s", baseline=f"{median_ci(samples[base])[0]:.2f} tok/s "
                   f"at {base}", ratio=ratio, runs=args.reps)


if __name__ == "__main__":
    main()
