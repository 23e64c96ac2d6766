"""Re-ranking latency per query, an int4 model against its fp32 original (issue 40's re-ranking goal):
`hardy eval rank` on the bundled WikiText-2 collection, each model in a fresh process, the two alternating
(the order swapped every repetition), the first `--queries` test queries, BM25's top `--k` re-ranked.
Reported: each model's median latency per query, the per-pair ratio int4 / fp32 with a 95% interval, and
the int4 model's per-query nDCG@10 against fp32's on the same queries (mean difference and paired z).

    .venv/bin/python -m hardy export --model smollm2-135m --format safetensors --dtype fp32 --out /tmp/rank/smollm2-fp32
    .venv/bin/python -m hardy compress --model smollm2-135m --quant rtn --bits 4 --group-size 32 --out /tmp/rank/smollm2-int4
    .venv/bin/python bench/rank_latency.py --fp32 /tmp/rank/smollm2-fp32 --int4 /tmp/rank/smollm2-int4 --reps 5 --record
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402
from results import record  # noqa: E402


def rank_run(model: str, args, out: Path, activations: str = "fp32") -> dict:
    """The QLM row of one `hardy eval rank` process (its latency and per-query nDCG@10)."""
    cmd = [sys.executable, "-m", "hardy", "eval", "rank", "--model", model, "--k", str(args.k), "--alpha", "0.2",
           "--max-queries", str(args.queries), "--threads", str(args.threads), "--prefill-dtype", args.prefill_dtype,
           "--activations", activations, "--json", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"hardy eval rank failed on {model}:\n{proc.stderr[-2000:]}")
    rows = json.loads(out.read_text())["rows"]
    return next(r for r in rows if r["model"] and r["system"].endswith("QLM"))


def paired_z(a: dict[str, float], b: dict[str, float]) -> tuple[float, float]:
    """(mean of a − b, its z) over the queries both have."""
    diffs = [a[q] - b[q] for q in sorted(a) if q in b]
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    return mean, (mean / (sd / math.sqrt(len(diffs))) if sd else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp32", required=True, help="the fp32 model")
    ap.add_argument("--int4", required=True, help="the int4 model")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--queries", type=int, default=10, help="the first N test queries")
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-dtype", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--int4-activations", default="fp32", choices=("fp32", "bf16"),
                    help="the int4 model's --activations (the fp32 model's stay fp32)")
    ap.add_argument("--record", action="store_true", help="write the ratio to bench/results/ (BENCHMARKS.md)")
    args = ap.parse_args()
    lat: dict[str, list[float]] = {"fp32": [], "int4": []}
    ndcg: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = ("fp32", "int4") if rep % 2 == 0 else ("int4", "fp32")
            for name in order:
                row = rank_run(getattr(args, name), args, Path(tmp) / f"{name}.json",
                               args.int4_activations if name == "int4" else "fp32")
                lat[name].append(row["latency_median_ms"] / 1000)
                ndcg[name] = row["per_query_ndcg"]
            print(f"rep {rep + 1}: fp32 {lat['fp32'][-1]:.3f} s, int4 {lat['int4'][-1]:.3f} s per query "
                  f"({lat['int4'][-1] / lat['fp32'][-1]:.2f}x)", flush=True)
    ratio = median_ci([a / b for a, b in zip(lat["int4"], lat["fp32"])])
    diff, z = paired_z(ndcg["int4"], ndcg["fp32"])
    setting = f"--prefill-dtype {args.prefill_dtype}, int4 --activations {args.int4_activations}"
    print(f"\n{cpu_line()}; {args.queries} queries, k = {args.k}, {setting}")
    print("| measure | median [95% interval] |\n|---|---|")
    print(f"| fp32 latency per query, s | {fmt(*median_ci(lat['fp32']), digits=3)} |")
    print(f"| int4 latency per query, s | {fmt(*median_ci(lat['int4']), digits=3)} |")
    print(f"| int4 / fp32, per pair | {fmt(*ratio, digits=2)} |")
    print(f"int4 nDCG@10 − fp32's over {len(ndcg['int4'])} queries: {100 * diff:+.2f} points, paired z {z:+.2f}")
    if args.record:
        record("rerank-int4-latency-vs-fp32", issue=40, goal="Re-ranking latency per query, int4 / fp32, SmolLM2",
               target=("<=", 0.5), figure=f"int4 p50 {median_ci(lat['int4'])[0]:.3f} s per query",
               baseline=f"fp32 p50 {median_ci(lat['fp32'])[0]:.3f} s per query", ratio=ratio, runs=args.reps,
               note=f"the first {args.queries} test queries, k {args.k}, {setting}; int4 "
                    f"nDCG@10 {100 * diff:+.2f} points against fp32 on them (paired z {z:+.2f})")


if __name__ == "__main__":
    main()
