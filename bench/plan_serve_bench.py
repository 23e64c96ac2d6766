"""Planner check: predicted vs measured SmolLM2-135M fp32 decode tokens/s at batch 1 on this machine.

1. `hardy probe` measures this machine (memory bandwidth, matmul FLOP/s) into a profile;
2. `plan_serve(..., hardware probe:PROFILE)` predicts decode tokens/s for the request shape
   below (no efficiency factor: a probe profile's numbers are measured);
3. hardy's own generate loop decodes the same request (greedy, same prompt as
   bench/decode_speed.py) and its GenerationStats give the measured rates; median of --repeats;
4. diagnostic: the rate torch's batch-1 matmul streams at this model's shapes, and what the same
   formula predicts with it (separates the byte count from the bandwidth figure).

    .venv/bin/python bench/plan_serve_bench.py --threads 2 --new-tokens 128 --repeats 3
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPT = "The history of the Roman Empire begins with"  # bench/decode_speed.py's default


def probe(out: Path, workdir: Path, threads: int) -> None:
    cmd = [sys.executable, "-m", "hardy", "probe", "--out", str(out), "--dir", str(workdir)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})


def gemv_bandwidth(cfg, repeats: int = 5) -> float:
    """Diagnostic, not part of the prediction: bytes/s that torch's batch-1 F.linear streams over
    random weights with this model's matrix shapes (all layers + LM head, more than the caches hold)."""
    d, q, kv, f = cfg.dim, cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.ffn_dim
    layer = [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]
    weights = [torch.randn(shape) for _ in range(cfg.n_layers) for shape in layer]
    weights.append(torch.randn(cfg.vocab_size, d))
    xs = {k: torch.randn(1, k) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
            best = min(best, time.perf_counter() - t0)
    return sum(w.numel() * w.element_size() for w in weights) / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", default=None, help="reuse a profile written by `hardy probe` instead of probing")
    ap.add_argument("--dir", default=None, help="scratch directory for the probe (default: a temporary one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.2f} (other jobs on the cores distort both numbers)")

    from hardy.loading.load import load_model
    from hardy.infer.generate import SamplingConfig, generate
    from hardy.plan.hardware import get_hardware
    from hardy.plan.serve import plan_serve

    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(args.profile) if args.profile else Path(tmp) / "profile.json"
        if not args.profile:
            probe(profile, Path(args.dir or tmp), args.threads)
        hw = get_hardware(f"probe:{profile}")

        loaded = load_model("smollm2-135m")
        prompt = loaded.tokenizer.encode(PROMPT)
        n_new = args.new_tokens
        plan = plan_serve(loaded.config, hw, quant="fp32", context=len(prompt) + n_new,
                          prompt_tokens=len(prompt), output_tokens=n_new, batch=1)

        cfg = SamplingConfig(max_new_tokens=n_new)
        generate(loaded.model, prompt, cfg)  # warm-up
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = generate(loaded.model, prompt, cfg)
            runs.append((time.perf_counter() - t0, result.stats))
            assert result.stats.new_tokens == n_new
        gemv = gemv_bandwidth(loaded.config)
        diag = plan_serve(loaded.config, dataclasses.replace(hw, memory_bandwidth=gemv), quant="fp32",
                          context=len(prompt) + n_new, prompt_tokens=len(prompt), output_tokens=n_new, batch=1)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    decode = statistics.median(s.decode_tps for _, s in runs)  # steps after the first token
    end_to_end = n_new / statistics.median(t for t, _ in runs)  # what bench/decode_speed.py reports
    pred_decode, pred_e2e = plan.decode_tokens_per_s, n_new / plan.request_latency_s

    print(f"\nhardware {hw.name}: {hw.achievable_bandwidth() / 1e9:.1f} GB/s, "
          f"{hw.achievable_flops('fp32') / 1e9:.1f} GFLOP/s fp32 (measured by hardy probe)")
    print(f"SmolLM2-135M fp32, batch 1, {args.threads} threads, {len(prompt)}-token prompt, {n_new} new tokens, "
          f"median of {args.repeats}")
    print(f"  plan: {plan.step_bytes_per_device / 1e6:.1f} MB read per step -> step {plan.step_s * 1e3:.1f} ms "
          f"({plan.bound}-bound; memory {plan.step_memory_s * 1e3:.1f} ms, compute {plan.step_compute_s * 1e3:.1f} ms, "
          f"dispatch {plan.step_dispatch_s * 1e3:.1f} ms), prefill {plan.prefill_s * 1e3:.1f} ms")
    print(f"  {'':<26}{'predicted':>10}{'measured':>10}{'ratio':>8}")
    for name, p, m in (("decode tokens/s", pred_decode, decode), ("end-to-end tokens/s", pred_e2e, end_to_end)):
        print(f"  {name:<26}{p:10.1f}{m:10.1f}{p / m:8.2f}")
    print("  measured runs: " + ", ".join(f"{t:.2f}s ({s.decode_tps:.1f} decode tokens/s)" for t, s in runs))
    ok = abs(pred_decode / decode - 1) <= 0.30
    print(f"  decode prediction within 30% of measured: {ok}")
    print(f"diagnostic: torch fp32 batch-1 linear streams {gemv / 1e9:.1f} GB/s over this model's matrix shapes "
          f"(probe copy: {hw.memory_bandwidth / 1e9:.1f} GB/s); with that bandwidth the same formula predicts "
          f"{diag.decode_tokens_per_s:.1f} decode tokens/s, ratio {diag.decode_tokens_per_s / decode:.2f}")


if __name__ == "__main__":
    main()
