"""Memory per process of `hardy generate --tp N` against one process, on the same GGUF file: each
tensor-parallel worker reads only its rows/columns of the attention and MLP matrices from the mapped
file (the embeddings, LM head and norms are replicated), so its peak RSS should be ~1/N of the
sharded weights + the replicated ones + its KV cache. Peak RSS = the largest VmHWM seen for each
worker process (polled every 0.2 s while the command runs; psutil), and the decode rate hardy prints.

    .venv/bin/python bench/tp_memory.py --model /tmp/big/llama3.1-8b.Q4_0.gguf --tp 2
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil


def vm_hwm(proc: psutil.Process) -> int:
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return 0


def run(cmd: list[str]) -> tuple[dict[int, int], str, str]:
    """Peak RSS of every python process the command starts (the launcher included), its stdout and stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        try:
            for p in [root, *root.children(recursive=True)]:
                if "python" in p.name() or "hardy" in " ".join(p.cmdline()):
                    peaks[p.pid] = max(peaks.get(p.pid, 0), vm_hwm(p))
        except psutil.Error:
            pass
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return peaks, out, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    base = [sys.executable, "-m", "hardy", "generate", "--model", args.model, "--prompt", "The history of the",
            "--max-new-tokens", str(args.new_tokens), "--threads", str(args.threads), "--stats"]
    size = __import__("os").path.getsize(args.model)
    for label, extra in (("1 process", []), (f"--tp {args.tp}", ["--tp", str(args.tp)])):
        peaks, _, err = run(base + extra)
        workers = sorted(peaks.values(), reverse=True)
        if extra:  # the launcher (torchrun's parent) holds no weights: the N largest are the workers
            workers = workers[:args.tp]
        else:
            workers = workers[:1]
        stats = [line for line in err.splitlines() if "tok/s" in line or "tokens/s" in line]
        print(f"{label:10}: peak RSS per worker {', '.join(f'{w / 1e9:.2f} GB' for w in workers)} "
              f"(file {size / 1e9:.2f} GB; {max(workers) / size:.2f}x)  {stats[-1].strip() if stats else ''}",
              flush=True)


if __name__ == "__main__":
    main()
