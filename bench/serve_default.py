"""`hardy serve` with default flags on a file that declares a 131,072-position context (a Llama-3.2-1B-shaped
Q4_0 GGUF with random weights, written by bench/big_cpu_model.py): 8 concurrent clients, and the server's
peak resident memory against the file's size (the issue-37 goal: peak RSS <= file + 3 GiB; before the
paged cache, the default context was the model's 131,072 and the fp32 cache was reserved for every
--max-batch row up front: 22.9 GB, killed). llama-server with its own defaults runs the same load for
comparison (this version fits its context to the free memory: it says how many positions per slot).

    python bench/serve_default.py --dir /tmp/serve-default
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from big_cpu_model import write_gguf  # noqa: E402
from native import llama_bin, wait_healthy  # noqa: E402

PROMPT = "The history of the Roman Empire begins with the founding of the city, and " * 12


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (0 once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("VmHWM:")), 0)


def clients(port: int, n: int, max_tokens: int, path: str = "/v1/completions") -> list[dict]:
    out = [None] * n

    def one(i):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
        body = {"prompt": PROMPT + f" ({i})", "max_tokens": max_tokens, "temperature": 0}
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            out[i] = {"status": resp.status, "body": json.loads(resp.read())}
        except OSError as e:  # the server went away (killed for memory, say): counted, not raised
            out[i] = {"status": f"{type(e).__name__}", "body": {}}
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def summary(answers: list[dict], wall: float, pid: int) -> dict:
    ok = [a for a in answers if a["status"] == 200]
    tokens = sum(a["body"]["usage"]["completion_tokens"] for a in ok)
    return {"peak_rss": peak_rss(pid), "answered": len(ok), "tokens_per_s": tokens / wall}


def wait_port(proc, pattern: str) -> int:
    line = proc.stdout.readline()
    if pattern not in line:
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()[-2000:]}")
    return int(line.split("http://127.0.0.1:")[1].split("/")[0])


def run_hardy(model: Path, n: int, max_tokens: int) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "hardy", "serve", "--model", str(model), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        port = wait_port(proc, "serving")
        t0 = time.perf_counter()
        answers = clients(port, n, max_tokens)
        result = summary(answers, time.perf_counter() - t0, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    return {**result, "startup": next((line for line in err.splitlines() if "KV cache" in line), "")}


def run_llama_server(model: Path, n: int, max_tokens: int, threads: int) -> dict:
    port = 18000 + os.getpid() % 1000
    log = Path(f"/tmp/llama-server-{port}.log")
    proc = subprocess.Popen([str(llama_bin() / "llama-server"), "-m", str(model), "--port", str(port), "-t", str(threads),
                             "--parallel", str(n)], stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        wait_healthy(port, proc, 300)  # up to 5 minutes for the model to load; a server that never comes up
        t0 = time.perf_counter()      # leaves its clients unanswered, which the summary counts
        answers = clients(port, n, max_tokens)
        result = summary(answers, time.perf_counter() - t0, proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    slot = next((line.split("n_ctx_slot = ")[1].split(",")[0] for line in log.read_text().splitlines()
                 if "n_ctx_slot" in line), "?")
    return {**result, "slot_ctx": slot}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/serve-default")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    args = ap.parse_args()
    model = Path(args.dir) / "llama3.2-1b-Q4_0-ctx131072.gguf"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(model, "llama3.2-1b", "Q4_0")
    size = model.stat().st_size
    gib = 2 ** 30
    ours = run_hardy(model, args.clients, args.max_tokens)
    print(f"file {size / gib:.2f} GiB ({model.name}: context_length 131072)")
    print(f"hardy serve (default flags): {ours['answered']}/{args.clients} answered, peak RSS {ours['peak_rss'] / gib:.2f} GiB "
          f"= file + {(ours['peak_rss'] - size) / gib:.2f} GiB (goal <= file + 3 GiB), {ours['tokens_per_s']:.1f} tokens/s")
    print(f"  {ours['startup']}")
    if not args.no_llama:
        theirs = run_llama_server(model, args.clients, args.max_tokens, args.threads)
        print(f"llama-server (its defaults, --parallel {args.clients}): {theirs['answered']}/{args.clients} answered, "
              f"peak RSS {theirs['peak_rss'] / gib:.2f} GiB (0: the process was gone), {theirs['tokens_per_s']:.1f} "
              f"tokens/s; its context per slot: {theirs['slot_ctx']}")


if __name__ == "__main__":
    main()
