"""Serving many users against llama.cpp's own server (issue 40's serving goal): `--clients` concurrent
streaming clients, each one completion of a ~`--prompt-tokens` prompt and `--max-tokens` new tokens
(greedy), on `hardy serve --max-batch N` and on `llama-server -np N -cb` with the same file, threads and
per-slot context; a fresh server per run, the two alternating (the order swapped every repetition).

Reported per engine: total completion tokens/s over the wall time from the first request to the last
answer, and each request's time to first token (the first streamed text) at p50 and p99; the per-pair
ratio of throughputs (hardy / llama-server) with a 95% interval.

    .venv/bin/python bench/serve_vs_llama.py --model /tmp/big/llama3.1-8b.Q4_0.gguf --reps 5 --record
"""
from __future__ import annotations

import argparse
import http.client
import native
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from native import cpu_line, fmt, llama_bin, llama_cpp_label, median_ci  # noqa: E402
from results import record, slug  # noqa: E402

# 11 tokens of SmolLM2's BPE (the 8B-shaped files' vocabulary) per repetition, and 3 for a client's own
# number, which keeps the prompts distinct so that no engine can share a prefix cache between them
UNIT, UNIT_TOKENS, NUMBER_TOKENS = "The history of the Roman Empire begins with the city. ", 11, 3


def stream(port: int, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: time to the first text, the end, completion tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    first, pieces, usage = None, 0, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if event.get("usage"):
            usage = event["usage"]
        # a token's event: text, or none yet (llama-server sends "" while a UTF-8 sequence is incomplete,
        # which random-weight files produce all the time); the last event carries a finish_reason
        if any(c.get("text") or c.get("finish_reason") is None for c in event.get("choices", [])):
            pieces += 1
            if first is None:
                first = time.perf_counter() - t0
    conn.close()
    tokens = usage["completion_tokens"] if usage else pieces
    return {"ttft": first if first is not None else float("nan"), "end": time.perf_counter(), "tokens": tokens,
            "prompt_tokens": usage["prompt_tokens"] if usage else None}


def load(port: int, args) -> dict:
    """All clients at once; throughput over the wall time, TTFT per request."""
    out: list[dict | None] = [None] * args.clients
    prompts = [f"({i}) " + UNIT * ((args.prompt_tokens - NUMBER_TOKENS) // UNIT_TOKENS) for i in range(args.clients)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, stream(port, prompts[i], args.max_tokens)))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise SystemExit("a client failed")
    wall = max(o["end"] for o in out) - t0
    return {"tokens_per_s": sum(o["tokens"] for o in out) / wall, "ttft": [o["ttft"] for o in out],
            "prompt_tokens": out[0]["prompt_tokens"], "tokens": sum(o["tokens"] for o in out)}


def run(engine: str, args) -> dict:
    """One run; llama.cpp's AMX build, where it crashes (bench/native.py), gives way to the one without AMX."""
    result = run_once(engine, args)
    if isinstance(result, int) and engine == "llama" and native.amx_build_crashed("llama-server", result):
        result = run_once(engine, args)
    if isinstance(result, int):  # the server exited before it came up
        raise SystemExit(f"{engine}'s server exited ({result})")
    return result


def run_once(engine: str, args) -> dict | int:
    """The load's result, or the server's exit status where it exited before it came up."""
    port = 18500 + os.getpid() % 1000
    context = args.prompt_tokens + args.max_tokens + 64
    if engine == "hardy":
        cmd = [sys.executable, "-m", "hardy", "serve", "--model", args.model, "--port", str(port), "--max-batch",
               str(args.clients), "--context", str(context), "--threads", str(args.threads)]
    else:
        cmd = [str(llama_bin(not native._amx_crashed) / "llama-server"), "-m", args.model, "--port", str(port),
               "-t", str(args.threads), "-np", str(args.clients), "-cb", "-c", str(context * args.clients)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not native.wait_healthy(port, proc, 600):
            if proc.poll() is not None:
                return proc.returncode
            raise SystemExit(f"{engine}'s server did not come up in 10 minutes")
        return load(port, args)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="write the ratio to bench/results/ (BENCHMARKS.md)")
    args = ap.parse_args()
    if not Path(args.model).is_file():
        raise SystemExit(f"no such file: {args.model}")
    runs: dict[str, list[dict]] = {"hardy": [], "llama": []}
    for rep in range(args.reps):
        for engine in (("hardy", "llama") if rep % 2 == 0 else ("llama", "hardy")):
            runs[engine].append(run(engine, args))
        h, l_ = runs["hardy"][-1], runs["llama"][-1]
        print(f"rep {rep + 1}: hardy {h['tokens_per_s']:.2f} tok/s ({h['tokens']} tokens, prompt {h['prompt_tokens']}), "
              f"llama-server {l_['tokens_per_s']:.2f} tok/s ({l_['tokens']} tokens, prompt {l_['prompt_tokens']})",
              flush=True)
    ratio = median_ci([a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["hardy"], runs["llama"])])
    print(f"\n{Path(args.model).name}, {args.clients} clients x (~{args.prompt_tokens} prompt + {args.max_tokens} new "
          f"tokens), {args.threads} threads, {cpu_line()}; {llama_cpp_label()}")
    rate = {name: median_ci([r["tokens_per_s"] for r in runs[name]]) for name in runs}
    ttft = {name: [t for r in runs[name] for t in r["ttft"]] for name in runs}
    print("| engine | completion tokens/s | TTFT p50, s | TTFT p99, s |\n|---|---|---|---|")
    for name, label in (("hardy", f"hardy serve --max-batch {args.clients}"),
                        ("llama", f"llama-server -np {args.clients} -cb")):
        print(f"| {label} | {fmt(*rate[name], digits=2)} | {statistics.median(ttft[name]):.1f} | "
              f"{pct(ttft[name], 0.99):.1f} |")
    print(f"| hardy / llama-server, per pair | {fmt(*ratio, digits=2)} | | |")
    if args.record:
        record(f"serve-vs-llama-server-{slug(args.model)}", issue=40,
               goal=f"Serving {args.clients} clients ({runs['hardy'][0]['prompt_tokens']}-token prompts, "
                    f"{args.max_tokens} new), "
                    f"{Path(args.model).name}, vs llama-server -np {args.clients} -cb",
               target=(">=", 2.0),
               figure=f"{rate['hardy'][0]:.2f} tok/s, TTFT p50 {statistics.median(ttft['hardy']):.1f} s, "
                      f"p99 {pct(ttft['hardy'], 0.99):.1f} s",
               baseline=f"llama-server {rate['llama'][0]:.2f} tok/s", ratio=ratio, runs=args.reps,
               note=llama_cpp_label())


if __name__ == "__main__":
    main()
