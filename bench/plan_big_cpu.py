"""Planner check at real size: `hardy plan serve` on this machine's probe profile against hardy's
measured decode speed, time to first token and peak memory on the same GGUF files (issue 21, item 6).

1. `hardy probe` measures this machine, including the rate hardy's fused int4 kernel streams
   quantized weights at (`quant_gemv`);
2. the plan: `plan_serve(config, probe:PROFILE, quant="file")` with the file's own tensor bytes
   (hardy.plan.weights), a 512-token prompt + 32 new tokens at batch 1;
3. the measurement: bench/big_cpu_model.py's hardy worker (a fresh process: native load, generate)
   on the same file, median of --repeats.

    .venv/bin/python bench/plan_big_cpu.py --dir /tmp/big --files llama3.1-8b:Q4_0,13b-class:Q4_0

The files are written by bench/big_cpu_model.py when missing (random weights, tensor by tensor).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/hardy-big")
    ap.add_argument("--files", default="llama3.1-8b:Q4_0,13b-class:Q4_0", help="shape:type,... (big_cpu_model.py)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--profile", default=None, help="reuse a profile written by `hardy probe`")
    args = ap.parse_args()

    from hardy.loading.load import config_for
    from hardy.plan.hardware import get_hardware
    from hardy.plan.serve import plan_serve
    from hardy.plan.weights import layout_from_gguf

    profile = Path(args.profile or Path(args.dir) / "probe.json")
    if args.profile is None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hardy", "probe", "--out", str(profile), "--dir", args.dir]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
                       stdout=subprocess.DEVNULL)
    hw = get_hardware(f"probe:{profile}")
    quant_rate = hw.quantized_decode_bandwidth
    print(f"probe: int4 kernel {quant_rate / 1e9 if quant_rate else float('nan'):.1f} GB/s, copy "
          f"{hw.memory_bandwidth / 1e9:.1f} GB/s, fp32 GEMV {hw.decode_rate(4096) / 1e9:.1f} GB/s", flush=True)
    rows = []
    for item in args.files.split(","):
        shape, qtype = item.split(":")
        path = Path(args.dir) / f"{shape}.{qtype}.gguf"
        base = [sys.executable, str(HERE / "big_cpu_model.py"), "--shape", shape, "--type", qtype, "--dir", args.dir,
                "--threads", str(args.threads), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens)]
        if not path.exists():  # the writer runs when the file is missing (engines: none)
            subprocess.run([*base, "--repeats", "0", "--engines", "hardy"], check=True)
        plan = plan_serve(config_for(str(path)), hw, quant="file", layout=layout_from_gguf(path),
                          context=args.prompt + args.new_tokens + 8, prompt_tokens=args.prompt,
                          output_tokens=args.new_tokens, batch=1)
        runs = []
        for _ in range(args.repeats):
            proc = subprocess.run([*base, "--worker", "hardy", "--batch", "1"], capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        m = {k: statistics.median(r[k] for r in runs) for k in ("decode_tps", "ttft_s", "peak_rss")}
        rows.append((f"{shape} {qtype}", plan, m))
        print(f"{shape} {qtype}: predicted decode {plan.decode_tokens_per_s:.2f} tok/s, measured {m['decode_tps']:.2f} "
              f"({plan.decode_tokens_per_s / m['decode_tps']:.2f}x); memory {plan.memory_per_device / 1e9:.2f} GB "
              f"vs peak RSS {m['peak_rss'] / 1e9:.2f} GB ({plan.memory_per_device / m['peak_rss']:.2f}x); TTFT "
              f"{plan.prefill_s:.1f} s vs {m['ttft_s']:.1f} s ({plan.prefill_s / m['ttft_s']:.2f}x)", flush=True)
    print("\n| file | decode predicted | measured | ratio | memory predicted | peak RSS | ratio | TTFT predicted | "
          "measured | ratio |\n|---|---|---|---|---|---|---|---|---|---|")
    for name, plan, m in rows:
        print(f"| {name} | {plan.decode_tokens_per_s:.2f} tok/s | {m['decode_tps']:.2f} | "
              f"{plan.decode_tokens_per_s / m['decode_tps']:.2f} | {plan.memory_per_device / 1e9:.2f} GB | "
              f"{m['peak_rss'] / 1e9:.2f} GB | {plan.memory_per_device / m['peak_rss']:.2f} | {plan.prefill_s:.1f} s | "
              f"{m['ttft_s']:.1f} s | {plan.prefill_s / m['ttft_s']:.2f} |")


if __name__ == "__main__":
    main()
