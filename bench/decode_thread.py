"""A fused decode step run by the main thread against the same step run by another thread (where the
serving engine runs its passes), alternating, >= 5 repetitions of 40 steps each.

    .venv/bin/python bench/decode_thread.py --model smollm2-135m --reps 5

Before the stack's spin barrier, libgomp put the waiting threads to sleep between the stack's phases
once a second thread had run a parallel region (it then manages more threads than there are CPUs), so
the engine thread's steps took ~3x the main thread's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    import torch

    from hardy.infer.fused_decode import decode_hidden
    from hardy.loading.load import load_model
    from hardy.serve.engine import ModelRunner

    model = load_model(args.model, gguf="native").model
    runner = ModelRunner(model, 1, 600, torch.bfloat16)
    runner.prefill(0, torch.randint(0, 1000, (1, 40)), 300)
    runner.cache.use([0])
    tokens, positions = torch.randint(0, 1000, (1, 1)), torch.full((1,), 40)

    def step_ms() -> float:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            decode_hidden(model, tokens, positions)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000

    def in_thread() -> float:
        out = []
        worker = threading.Thread(target=lambda: out.append(step_ms()))
        worker.start()
        worker.join()
        return out[0]

    main_ms, thread_ms = [], []
    for _ in range(args.reps):
        main_ms.append(step_ms())
        thread_ms.append(in_thread())
    ratios = [t / m for t, m in zip(thread_ms, main_ms)]
    print(f"# {cpu_line()}; {args.model}; one row at position 40; {args.reps} alternating repetitions of "
          f"{args.steps} steps (median each)")
    print(f"main thread {fmt(*median_ci(main_ms), digits=2)} ms, other thread {fmt(*median_ci(thread_ms), digits=2)} ms, "
          f"ratio {fmt(*median_ci(ratios), digits=2)}")


if __name__ == "__main__":
    main()
