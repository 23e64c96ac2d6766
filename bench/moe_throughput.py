"""Prefill, batched decode and peak memory of a mixture-of-experts GGUF (issue 38's goals besides batch-1
decode), alternating llama.cpp's own `llama-bench` (pp`--prompt`) with a fresh hardy process per repetition
(`bench/big_cpu_model.py`'s worker: native load, the `--prompt`-token prefill as `hardy generate` runs it,
then its serving step over 8 sequences and over 1).

    .venv/bin/python bench/moe_shaped.py --out /tmp/q3moe12.gguf --layers 12 --type Q4_0
    .venv/bin/python bench/moe_throughput.py --model /tmp/q3moe12.gguf --reps 5

Reported: prefill tokens/s of both and their ratio per pair; hardy's batch-8 serving throughput over its
batch-1 throughput through the same step; hardy's peak RSS over the file size plus the request's KV cache
(fp32, as `generate` holds it by default; the batched runs come after the peak is read).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, llama_bench, llama_cpp_label, median_ci  # noqa: E402
from results import record, slug  # noqa: E402

HERE = Path(__file__).resolve().parent


def kv_bytes(path: Path, tokens: int) -> int:
    """The fp32 KV cache of one `tokens`-long sequence, from the file's metadata."""
    from hardy.formats.gguf_io import open_gguf, read_config
    from hardy.plan.serve import kv_bytes_per_token

    return round(kv_bytes_per_token(read_config(open_gguf(path), path), "fp32") * tokens)


def hardy_run(path: Path, threads: int, prompt: int, new_tokens: int, batch: int) -> dict:
    cmd = [sys.executable, str(HERE / "big_cpu_model.py"), "--worker", "hardy", "--model", str(path),
           "--threads", str(threads), "--prompt", str(prompt), "--new-tokens", str(new_tokens), "--batch", str(batch)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"hardy worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def goal(op: str, value: float):
    return (op, value) if value else None


def record_prefill(args, path: Path, ours: list, theirs: list) -> None:
    record(f"prefill-vs-llama-bench-{slug(str(path))}", issue=args.issue, goal=f"Prefill pp{args.prompt}, {path.name}, "
           f"{args.threads} threads, vs llama-bench", target=goal(">=", args.prefill_goal),
           figure=f"{median_ci(ours)[0]:.1f} tok/s", baseline=f"llama-bench {median_ci(theirs)[0]:.1f} tok/s",
           ratio=median_ci([a / b for a, b in zip(ours, theirs)]), runs=args.reps, note=llama_cpp_label())


def record_goals(args, path: Path, ours: list, theirs: list, runs: list, gain: tuple, rss: tuple) -> None:
    """The three ratios against their goals (issue 38's by default: prefill >= 1.0x llama-bench's, batch 8
    >= 3x batch 1, peak RSS <= 1.1x file + KV; a goal of 0 records the ratio without one)."""
    name = slug(str(path))
    record_prefill(args, path, ours, theirs)
    record(f"batch{args.batch}-vs-batch1-{name}", issue=args.issue, goal=f"Batch-{args.batch} decode throughput / "
           f"batch 1, {path.name}", target=goal(">=", args.batch_goal),
           figure=f"{median_ci([r['batch_tps'] for r in runs])[0]:.1f} tok/s",
           baseline=f"batch 1 {median_ci([r['batch1_step_tps'] for r in runs])[0]:.1f} tok/s", ratio=gain,
           runs=args.reps)
    record(f"peak-rss-{name}", issue=args.issue, goal=f"Peak RSS / (file + KV), {path.name}",
           target=goal("<=", args.rss_goal), figure=None, baseline=None, ratio=rss, runs=args.reps, digits=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32, help="batch-1 tokens after the prompt; half as many steps batched")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pause", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--prefill-only", action="store_true",
                    help="measure (and with --record write) the prefill ratio alone: no decode, no batched step")
    ap.add_argument("--record", action="store_true", help="write the three ratios to bench/results/ "
                    "(BENCHMARKS.md's table)")
    ap.add_argument("--issue", type=int, default=38, help="with --record: the issue that set the goals")
    ap.add_argument("--prefill-goal", type=float, default=1.0, help="with --record: the prefill ratio's lower bound")
    ap.add_argument("--batch-goal", type=float, default=3.0, help="with --record: batch / batch 1's lower bound")
    ap.add_argument("--rss-goal", type=float, default=1.1, help="with --record: peak RSS / (file + KV)'s upper bound")
    args = ap.parse_args()
    path = Path(args.model)
    if not path.is_file():
        raise SystemExit(f"no such file: {path}")
    size = path.stat().st_size
    kv = kv_bytes(path, args.prompt + args.new_tokens)
    if args.prefill_only:
        args.new_tokens, args.batch = 1, 1
    theirs, runs = [], []
    for rep in range(args.reps):
        time.sleep(args.pause)
        theirs += llama_bench(path, args.threads, prompt=args.prompt, gen=0)
        time.sleep(args.pause)
        r = hardy_run(path, args.threads, args.prompt, args.new_tokens, args.batch)
        r["prefill_tps"] = args.prompt / r["ttft_s"]
        runs.append(r)
        batched = "" if args.prefill_only else (f"hardy batch {args.batch} {r['batch_tps']:.1f}, batch 1 "
                                                 f"{r['batch1_step_tps']:.1f} tokens/s; ")
        print(f"rep {rep + 1}: prefill llama.cpp {theirs[-1]:.1f}  hardy {r['prefill_tps']:.1f} tokens/s; {batched}"
              f"peak RSS {r['peak_rss'] / 2 ** 30:.2f} GiB", flush=True)
    ours = [r["prefill_tps"] for r in runs]
    gain = median_ci([r["batch_tps"] / r["batch1_step_tps"] for r in runs])
    rss = median_ci([r["peak_rss"] / (size + kv) for r in runs])
    print(f"\n{path.name} ({size / 2 ** 30:.2f} GiB), {args.threads} threads, {cpu_line()}; {llama_cpp_label()}")
    print("| measure | median [95% interval] |\n|---|---|")
    print(f"| llama-bench pp{args.prompt}, tokens/s | {fmt(*median_ci(theirs))} |")
    print(f"| hardy prefill of {args.prompt} tokens, tokens/s | {fmt(*median_ci(ours))} |")
    print(f"| prefill ratio hardy / llama.cpp, per pair | {fmt(*median_ci([a / b for a, b in zip(ours, theirs)]), digits=2)} |")
    if not args.prefill_only:
        print(f"| hardy batch {args.batch}, tokens/s (all sequences) | {fmt(*median_ci([r['batch_tps'] for r in runs]))} |")
        print(f"| hardy batch 1 (same serving step), tokens/s | {fmt(*median_ci([r['batch1_step_tps'] for r in runs]))} |")
        print(f"| batch {args.batch} / batch 1 throughput | {fmt(*gain, digits=2)} |")
    print(f"| hardy peak RSS / (file + {kv / 2 ** 20:.0f} MiB fp32 KV) | {fmt(*rss, digits=3)} |")
    if args.record and args.prefill_only:
        record_prefill(args, path, ours, theirs)
    elif args.record:
        record_goals(args, path, ours, theirs, runs, gain, rss)
    if args.json:
        Path(args.json).write_text(json.dumps({"file": str(path), "bytes": size, "kv_bytes": kv, "threads": args.threads,
                                               "llama_bench_pp": theirs, "hardy": runs, "cpu": cpu_line(),
                                               "llama_cpp_build": llama_cpp_label()}, indent=1))


if __name__ == "__main__":
    main()
