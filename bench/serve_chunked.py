"""Chunked prefill under load: the token gaps of running streams while a long prompt is admitted,
against their gaps just before it, on `hardy serve` over HTTP, with --prefill-chunk auto
and 0 (the default: each prompt in one pass), alternating, >= 5 repetitions.

    .venv/bin/python bench/serve_chunked.py --model smollm2-135m --long-tokens 8000 --reps 5

Each trial: a fresh server; two clients stream greedy 128-token completions back to back (so their
positions stay short); once both have streamed 20 chunks, their next 200 gaps within a completion are
the baseline; then a third client sends the long prompt (max_tokens 1) and the streams' gaps within a
completion that overlap its admission are the "during" sample. Issue 40's goal: the streams' p99 gap
during the admission of an 8k-token prompt is <= 2x their p99 without it.
"""
from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402
from results import record, slug  # noqa: E402
from serve_load import start  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STREAM_PROMPTS = ["The history of the Roman Empire", "Photosynthesis is the process"]
STREAM_TOKENS = 128


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"request failed: {payload}")
    return payload


class Stream(threading.Thread):
    """A client that streams completions of STREAM_TOKENS tokens one after another until stopped, so its
    positions stay short (a stream grown to thousands of tokens would slow for its own context);
    `arrivals` holds each request's chunk arrival times."""

    def __init__(self, port: int, prompt: str):
        super().__init__(daemon=True)
        self.port, self.prompt = port, prompt
        self.arrivals: list[list[float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        body = json.dumps({"prompt": self.prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
                           "stream": True}).encode()
        while not self.stopped.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            times: list[float] = []
            self.arrivals.append(times)
            for line in conn.getresponse():
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
            conn.close()

    def count_after(self, t: float) -> int:
        return sum(1 for times in self.arrivals for x in times if x > t)

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps between consecutive chunks of one request that overlap [start, end] (a stall straddling
        either end counts whole)."""
        return [b - a for times in self.arrivals for a, b in zip(times, times[1:]) if b > start and a < end]


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def wait_for(predicate, timeout: float) -> None:
    end = time.time() + timeout
    while not predicate():
        if time.time() > end:
            raise SystemExit("timed out")
        time.sleep(0.01)


def trial(model: str, chunk: str, long_text: str, context: int, threads: int | None) -> dict:
    proc, port = start(model, 4, threads, "--context", str(context), "--max-tokens", str(context - 64),
                       "--prefill-chunk", chunk)
    try:
        post(port, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})  # warm-up
        streams = [Stream(port, p) for p in STREAM_PROMPTS]
        for s in streams:
            s.start()
        wait_for(lambda: all(s.count_after(0) >= 20 for s in streams), 300)
        t_base = time.perf_counter()
        wait_for(lambda: all(s.count_after(t_base) >= 200 for s in streams), 300)
        t0 = time.perf_counter()
        answer = post(port, {"prompt": long_text, "max_tokens": 1, "temperature": 0})
        t1 = time.perf_counter()
        wait_for(lambda: all(s.count_after(t1) >= 2 for s in streams), 300)  # the gap across t1 ends
        during = [g for s in streams for g in s.gaps(t0, t1)]
        before = [b - a for s in streams for times in s.arrivals for a, b in zip(times, times[1:])
                  if a >= t_base and b <= t0]
        for s in streams:
            s.stopped.set()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return {"p99_before": p99(before), "p99_during": p99(during), "ratio": p99(during) / p99(before),
            "ttft_long": t1 - t0, "prompt_tokens": answer["usage"]["prompt_tokens"], "gaps_during": len(during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--long-tokens", type=int, default=8000, help="about this many tokens in the long prompt")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="auto,0", help="--prefill-chunk values, alternated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="write each mode's p99 ratio to bench/results/ "
                    "(BENCHMARKS.md's table)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from hardy.data.text import resolve_text_path

    # ~3.3 characters per token for SmolLM2's tokenizer on Shakespeare; the answer's usage gives the count
    long_text = resolve_text_path("tinyshakespeare").read_text()[:int(args.long_tokens * 3.2)]
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.reps):
        for mode in modes:
            r = trial(args.model, mode, long_text, args.context, args.threads)
            results[mode].append(r)
            print(f"rep {rep + 1} --prefill-chunk {mode}: streams' p99 gap {r['p99_before'] * 1e3:.0f} ms before, "
                  f"{r['p99_during'] * 1e3:.0f} ms during ({r['ratio']:.2f}x, {r['gaps_during']} gaps); long prompt "
                  f"{r['prompt_tokens']} tokens, first token after {r['ttft_long']:.1f} s", flush=True)
    print(f"\n{args.model}, 2 streams + one {results[modes[0]][0]['prompt_tokens']}-token prompt, {args.threads} "
          f"threads, {cpu_line()}")
    print("| --prefill-chunk | streams' p99 gap before, ms | during, ms | during / before | long prompt's TTFT, s |")
    print("|---|---|---|---|---|")
    for mode, rows in results.items():
        print(f"| {mode} | {fmt(*median_ci([r['p99_before'] * 1e3 for r in rows]), digits=0)} "
              f"| {fmt(*median_ci([r['p99_during'] * 1e3 for r in rows]), digits=0)} "
              f"| {fmt(*median_ci([r['ratio'] for r in rows]), digits=2)} "
              f"| {fmt(*median_ci([r['ttft_long'] for r in rows]))} |")
        if args.record:
            record(f"chunked-prefill-{slug(args.model)}-{mode}", issue=40,
                   goal=f"Streams' p99 token gap while a {rows[0]['prompt_tokens']:,}-token prompt is admitted / "
                   f"before, --prefill-chunk {mode}, {args.model}", target=("<=", 2.0),
                   figure=f"{median_ci([r['p99_during'] * 1e3 for r in rows])[0]:.0f} ms",
                   baseline=f"{median_ci([r['p99_before'] * 1e3 for r in rows])[0]:.0f} ms before",
                   ratio=median_ci([r["ratio"] for r in rows]), runs=args.reps)


if __name__ == "__main__":
    main()
