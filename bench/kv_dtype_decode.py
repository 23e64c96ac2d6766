"""Decode speed at a long context by KV cache dtype: a ~4,000-token WikiText prompt, then greedy decoding,
the paged cache in fp32, bf16 or fp16, alternating dtypes (the issue-37 goal: bf16 >= 0.95x fp32 at 4k).

    python bench/kv_dtype_decode.py --model smollm2-135m --reps 5
    python bench/kv_dtype_decode.py --model gemma3-270m --reps 5

SmolLM2's 30 layers of 3 KV heads read more KV bytes per step at 4k (fp32: 180 MiB) than weights (~80 MiB);
Gemma 3 270M's sliding layers read only their last 512 positions.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,bf16")
    args = ap.parse_args()
    from hardy.data.text import resolve_text_path
    from hardy.infer.generate import SamplingConfig, generate
    from hardy.infer.kv import KV_DTYPES
    from hardy.loading.load import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, gguf="native")
    ids = loaded.tokenizer.encode(resolve_text_path("wikitext2-valid").read_text(), special=False)
    prompt = ids[:args.context - args.new_tokens - 2]
    cfg = SamplingConfig(max_new_tokens=args.new_tokens + 1)
    dtypes = args.dtypes.split(",")
    samples = {d: [] for d in dtypes}
    for rep in range(args.reps):
        for d in dtypes if rep % 2 == 0 else reversed(dtypes):  # alternate which goes first
            g = generate(loaded.model, prompt, cfg, kv_dtype=KV_DTYPES[d])
            samples[d].append(g.stats.decode_tps)
        print(f"rep {rep + 1}: " + "  ".join(f"{d} {samples[d][-1]:.1f}" for d in dtypes), flush=True)
    print(f"\n{args.model}, prompt {len(prompt)} tokens + {args.new_tokens} decoded, {args.threads} threads, {cpu_line()}")
    print("| KV dtype | decode tokens/s, median [95% interval] |\n|---|---|")
    for d in dtypes:
        print(f"| {d} | {fmt(*median_ci(samples[d]))} |")
    base = dtypes[0]
    for d in dtypes[1:]:
        print(f"{d} / {base}, per repetition: {fmt(*median_ci([a / b for a, b in zip(samples[d], samples[base])]), digits=2)}")


if __name__ == "__main__":
    main()
