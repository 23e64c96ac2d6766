"""Decode speed of a GGUF model in hardy against llama.cpp's own `llama-bench` on the same file, alternating
(llama-bench tg, then hardy, repeated), same threads: tokens/s medians with a 95% interval and the ratio.

    python bench/family_decode.py --model gemma3-270m --reps 7            # the issue-37 goal: >= 1.2x
    python bench/family_decode.py --model FILE.gguf --kv-dtype fp32

hardy's run is `generate` from the file's BOS, `--new-tokens` greedy tokens through the fused decode stack
and the paged KV cache (--kv-dtype); llama-bench's tg test decodes the same number from an empty context
with its default f16 KV cache. Each hardy repetition is a fresh generation in one loaded process, or
with `--fresh` a fresh process (load, one warm-up generation, the measured one), as each llama-bench run
is: on a shared VM, the first seconds after a 5 GB process exits run slower (BENCHMARKS.md), and a
long-lived hardy process measured right after each llama-bench exit pays for that while llama-bench never
does; with `--fresh` both sides follow the other's exit.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, llama_bench, llama_cpp_label, median_ci  # noqa: E402
from results import record, slug  # noqa: E402


def in_process(args, cache: dict = {}) -> float:  # noqa: B006 (the loaded model, kept between calls)
    """Decode tokens/s of one generation in this process (the model loaded, and warmed up, on the first call)."""
    from hardy.infer.generate import SamplingConfig, generate
    from hardy.infer.kv import KV_DTYPES
    from hardy.loading.load import load_model

    if "model" not in cache:
        loaded = load_model(args.model, gguf="native")
        cache["model"] = loaded.model
        cache["prompt"] = [loaded.tokenizer.bos_id if loaded.tokenizer.bos_id is not None else 0]
        in_process(args)  # warm-up (first-touch of the weights, allocator)
    cfg = SamplingConfig(max_new_tokens=args.new_tokens + 1)  # the first comes from the prefill
    return generate(cache["model"], cache["prompt"], cfg, kv_dtype=KV_DTYPES[args.kv_dtype]).stats.decode_tps


def fresh_process(args) -> float:
    """in_process's figure from a fresh process: load, warm-up, then the measured generation."""
    worker = [sys.executable, __file__, "--worker", "--model", args.model, "--threads", str(args.threads),
              "--new-tokens", str(args.new_tokens), "--kv-dtype", args.kv_dtype]
    proc = subprocess.run(worker, capture_output=True, text=True, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--pause", type=float, default=1.0, help="seconds of rest before each run (both runtimes)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fresh", action="store_true", help="each hardy repetition in a fresh process")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record", action="store_true", help="write the ratio to bench/results/ (BENCHMARKS.md's table)")
    ap.add_argument("--goal", type=float, default=None, help="with --record: the goal's lower bound on the ratio")
    ap.add_argument("--issue", type=int, default=40, help="with --record: the issue that set the goal")
    args = ap.parse_args()

    from hardy.loading.load import resolve_source

    torch.set_num_threads(args.threads)
    _, path = resolve_source(args.model)
    hardy_tps = fresh_process if args.fresh and not args.worker else in_process
    if args.worker:
        print(hardy_tps(args))
        return
    ours, theirs = [], []
    for rep in range(args.reps):
        time.sleep(args.pause)
        theirs += llama_bench(path, args.threads, prompt=0, gen=args.new_tokens)
        time.sleep(args.pause)
        ours.append(hardy_tps(args))
        print(f"rep {rep + 1}: llama.cpp {theirs[-1]:.1f}  hardy {ours[-1]:.1f} tokens/s", flush=True)
    h, c = median_ci(ours), median_ci(theirs)
    ratios = median_ci([a / b for a, b in zip(ours, theirs)])
    print(f"\n{args.model} ({path.name}), {args.threads} threads, tg{args.new_tokens}, {cpu_line()}; {llama_cpp_label()}")
    print("| runtime | decode tokens/s, median [95% interval] |\n|---|---|")
    print(f"| llama.cpp llama-bench (f16 KV) | {fmt(*c)} |\n| hardy ({args.kv_dtype} KV) | {fmt(*h)} |")
    print(f"ratio hardy / llama.cpp, per alternating pair: {fmt(*ratios, digits=2)}"
          f"{' (hardy: a fresh process per repetition)' if args.fresh else ''}")
    if args.record:
        record(f"decode-vs-llama-bench-{slug(str(path))}", issue=args.issue,
               goal=f"Decode tg{args.new_tokens}, {path.name}, {args.threads} threads, vs llama-bench",
               target=None if args.goal is None else (">=", args.goal), figure=f"{h[0]:.1f} tok/s",
               baseline=f"llama-bench {c[0]:.1f} tok/s", ratio=ratios, runs=args.reps,
               note=llama_cpp_label() + ("; hardy a fresh process per run" if args.fresh else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "file": str(path), "threads": args.threads,
                                               "hardy": ours, "llama_cpp": theirs, "cpu": cpu_line(),
                                               "llama_cpp_build": llama_cpp_label(), "kv_dtype": args.kv_dtype}, indent=1))


if __name__ == "__main__":
    main()
