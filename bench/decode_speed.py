"""Decode tokens/s at batch 1: hardy (eager, and with its decode step under torch.compile) vs
transformers on the same SmolLM2-135M weights.

All run greedy decoding of the same prompt for the same number of new tokens on the same
thread count, alternating runs so machine noise hits both; medians and their ratio are printed.

    .venv/bin/python bench/decode_speed.py --threads 2 --new-tokens 128 --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from decode_common import add_decode_args, transformers_smollm2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hardy.loading.load import load_model
    from hardy.infer.generate import SamplingConfig, generate

    ours = load_model("smollm2-135m")
    prompt = ours.tokenizer.encode(args.prompt)
    cfg = SamplingConfig(max_new_tokens=args.new_tokens)
    run_hf = transformers_smollm2(prompt, args.new_tokens, ours.tokenizer.eos_id)

    def runner(compile: bool):
        def run():
            t0 = time.perf_counter()
            result = generate(ours.model, prompt, cfg, compile=compile)
            return time.perf_counter() - t0 - result.stats.compile_s, result.tokens  # compiled once, in the warm-up
        return run

    runners = (("hardy", runner(False)), ("hardy compiled", runner(True)), ("transformers", run_hf))
    t0 = time.perf_counter()
    runners[1][1]()
    print(f"(torch.compile of hardy's decode step, first generation: {time.perf_counter() - t0:.0f} s)")
    for _, fn in runners:
        fn()  # warm-up
    times = {name: [] for name, _ in runners}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in runners:
            dt, out = fn()
            times[name].append(dt)
            outputs[name] = out
    same = outputs["hardy"] == outputs["transformers"] == outputs["hardy compiled"]
    print(f"SmolLM2-135M fp32, batch 1, {args.threads} threads, {len(prompt)}-token prompt, "
          f"{args.new_tokens} new tokens, {args.repeats} runs each (median)")
    tps = {}
    for name, ts in times.items():
        tps[name] = args.new_tokens / statistics.median(ts)
        print(f"  {name:<15} {tps[name]:7.1f} tokens/s   (runs: {', '.join(f'{t:.2f}s' for t in ts)})")
    print(f"  ratio hardy/transformers: {tps['hardy'] / tps['transformers']:.2f}x   "
          f"compiled/eager: {tps['hardy compiled'] / tps['hardy']:.2f}x   "
          f"identical greedy tokens: {same}")


if __name__ == "__main__":
    main()
