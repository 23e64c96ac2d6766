"""Load on `hardy serve`: C concurrent clients each send R completion requests; requests/s,
generated tokens/s and p50/p99 latency, with continuous batching (--max-batch B) against the same
server decoding one request at a time (--max-batch 1), measured in the same run.

    .venv/bin/python bench/serve_load.py --model smollm2-135m --clients 8 --requests 4 --max-tokens 32
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The history of the Roman Empire", "Photosynthesis is the process", "In computer science, a hash table",
           "The French Revolution began", "A neural network is", "The Pacific Ocean", "Shakespeare wrote",
           "The theory of relativity"]


def start(model: str, max_batch: int, threads: int | None, *extra: str) -> tuple[subprocess.Popen, int]:
    """`hardy serve` on a free port (`extra`: more of its flags); the process and its port."""
    cmd = [sys.executable, "-m", "hardy", "serve", "--model", model, "--port", "0", "--max-batch", str(max_batch),
           "--max-queue", "256", *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = proc.stdout.readline()
    if "serving" not in line:
        raise SystemExit(f"server did not start: {line}{proc.stderr.read()}")
    return proc, int(line.split("http://127.0.0.1:")[1].split("/")[0])


def load(port: int, clients: int, requests: int, max_tokens: int) -> dict:
    latencies, tokens, errors = [], [], []

    def client(c):
        for r in range(requests):
            body = json.dumps({"prompt": PROMPTS[(c + r) % len(PROMPTS)], "max_tokens": max_tokens,
                               "temperature": 0}).encode()
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            payload = json.loads(resp.read())
            conn.close()
            if resp.status != 200:
                errors.append(payload)
                continue
            latencies.append(time.perf_counter() - t0)
            tokens.append(payload["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"requests_per_s": len(lat) / wall, "tokens_per_s": sum(tokens) / wall, "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "errors": len(errors), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    rows = {}
    for label, batch in ((f"continuous batching (max batch {args.max_batch})", args.max_batch),
                         ("one request at a time (max batch 1)", 1)):
        proc, port = start(args.model, batch, args.threads, "--context", "512")
        try:
            load(port, 1, 1, 4)  # warm-up
            rows[label] = load(port, args.clients, args.requests, args.max_tokens)
            conn = http.client.HTTPConnection("127.0.0.1", port)
            conn.request("GET", "/health")
            rows[label]["largest_batch"] = json.loads(conn.getresponse().read())["largest_batch"]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"{args.model}: {args.clients} clients x {args.requests} requests, {args.max_tokens} tokens each, "
          f"greedy; load average {os.getloadavg()[0]:.2f}")
    print(f"  {'server':<40} {'req/s':>7} {'tok/s':>7} {'p50 s':>7} {'p99 s':>7} {'batch':>6} {'errors':>6}")
    for label, r in rows.items():
        print(f"  {label:<40} {r['requests_per_s']:7.2f} {r['tokens_per_s']:7.1f} {r['p50_s']:7.2f} {r['p99_s']:7.2f} "
              f"{r['largest_batch']:6d} {r['errors']:6d}")
    a, b = rows.values()
    print(f"  throughput ratio (batching / one at a time): {a['tokens_per_s'] / b['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
