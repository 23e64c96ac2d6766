"""Training throughput of a real model's shape with `hardy train`, beside `hardy plan train`'s prediction.

Each configuration (activation checkpointing off/on x torch.compile off/on) is one `hardy train` run in a
fresh process on synthetic tokens of the model's vocabulary: FSDP2 at world size 1 (parallel.wrap =
fsdp: bf16 MixedPrecisionPolicy, fp32 master weights, gradients and AdamW states), the step timed with
CUDA events by the trainer. Reported per configuration: the median tokens/s of the steps after the
warm-up ones, MFU against the datasheet peak, peak device memory, and the planner's tokens/s and MFU
for the same job with the ratio measured / predicted. Results go to a JSON file as each run finishes.

    python bench/gpu_train_throughput.py --out gpu_train.json                       # GPU: 8 of Llama 3.1 8B's layers
    python bench/gpu_train_throughput.py --out t.json --preset tiny --layers 2 --seq 256 --device cpu \\
        --precision fp32 --steps 4 --warmup 2 --hardware epyc-genoa                 # the CPU rehearsal
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def synthetic_dataset(root: Path, vocab: int, tokens: int) -> Path:
    from hardy.data.prepare import write_token_dataset

    rng = np.random.default_rng(0)
    data = rng.integers(0, vocab - 1, tokens, dtype=np.int64)
    write_token_dataset(root, {"train": (data, 1), "val": (data[:4096], 1)}, vocab, vocab - 1, "synthetic", 0)
    return root


def run_config(name: str, sets: list[str], run_dir: Path, timeout: float, log) -> dict:
    cmd = [sys.executable, "-m", "hardy", "train", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log.write(f"=== {name}: {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    log.flush()
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return {"config": name, "error": tail, "wall_s": time.perf_counter() - t0}
    return {"config": name, "wall_s": time.perf_counter() - t0,
            "records": [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]}


def plan(model_json: Path, hardware: str, seq: int, ac: str, precision: str) -> dict:
    cmd = [sys.executable, "-m", "hardy", "plan", "train", "--model", str(model_json), "--hardware", hardware,
           "--devices", "1", "--seq", str(seq), "--global-batch-tokens", str(seq), "--micro-batch", "1",
           "--zero", "3", "--ac", ac, "--precision", precision, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    try:
        p = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    step = p.get("step_time_s") or {}
    return {"tokens_per_s": p.get("tokens_per_s"), "mfu": p.get("mfu"), "hfu": p.get("hfu"), "fits": p.get("fits"),
            "memory_gib": (p.get("memory_bytes") or {}).get("peak", 0) / 2 ** 30, "step_s": step.get("total_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="llama3.1-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median (compile, allocator)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet dense peak (H100/H200 bf16: 989)")
    ap.add_argument("--hardware", default="h200", help="the planner's catalogue entry for this device")
    ap.add_argument("--probe", default=None, help="a `hardy probe` profile of this device: also plan with it")
    ap.add_argument("--configs", default="ac=none,compile=false;ac=full,compile=false;ac=none,compile=true;"
                                         "ac=full,compile=true")
    ap.add_argument("--timeout", type=float, default=600.0, help="per configuration, seconds")
    args = ap.parse_args()

    from hardy.model.config import count_parameters, flops_per_token, get_preset

    cfg = get_preset(args.preset).replace(n_layers=args.layers)
    counts = count_parameters(cfg)
    fpt = flops_per_token(cfg, args.seq)
    out = Path(args.out)
    result = {"model": f"{args.preset} first {args.layers} layers", "parameters": counts.total, "seq": args.seq,
              "micro_batch": 1, "precision": args.precision, "device": args.device, "peak_tflops": args.peak_tflops,
              "flops_per_token": fpt, "hardware": args.hardware, "runs": []}
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
        result["torch"] = torch.__version__
    with tempfile.TemporaryDirectory(prefix="hardy-gpu-train-") as tmp:
        tmp = Path(tmp)
        data = synthetic_dataset(tmp / "data", cfg.vocab_size, max(1 << 20, (args.steps + 1) * (args.seq + 1) * 2))
        model_json = tmp / "model.json"
        model_json.write_text(json.dumps({"family": "llama", **cfg.to_dict()}))
        log = open(out.with_name(out.stem + ".runs.log"), "w")  # every hardy train output, in full
        for i, spec in enumerate(args.configs.split(";")):
            opts = dict(kv.split("=") for kv in spec.split(","))
            name = f"ac {opts['ac']}, compile {'on' if opts['compile'] == 'true' else 'off'}"
            sets = [f"model.preset={args.preset}", f"model.n_layers={args.layers}", f"data.path={data}",
                    f"data.seq_len={args.seq}", "train.micro_batch=1", f"train.steps={args.steps}",
                    f"train.activation_checkpoint={opts['ac']}", f"train.compile={opts['compile']}",
                    "train.deterministic=false", f"train.peak_tflops={args.peak_tflops}", "parallel.wrap=fsdp",
                    f"parallel.backend={'nccl' if args.device == 'cuda' else 'gloo'}",
                    f"precision.dtype={args.precision}", "checkpoint.at_end=false", "fault.spike_detection=false",
                    "log.progress=false", "optim.warmup_steps=1"]
            run = run_config(name, sets, tmp / f"run{i}", args.timeout, log)
            records = run.pop("records", [])
            steps = [r for r in records if r.get("event") == "step"][args.warmup:]
            if steps:
                tps = statistics.median(r["tokens_per_s"] for r in steps)
                run.update(tokens_per_s=tps, mfu=tps * fpt / (args.peak_tflops * 1e12),
                           step_s=statistics.median(r["step_time_s"] for r in steps),
                           peak_mem_gib=max(r["peak_mem_bytes"] for r in steps) / 2 ** 30,
                           losses=[r["loss"] for r in records if r.get("event") == "step"])
            predicted = plan(model_json, args.hardware, args.seq, opts["ac"], args.precision)
            run["planner"] = predicted
            if args.probe:  # the planner on this device's measured rates, beside its datasheet figures
                run["planner_probe"] = plan(model_json, f"probe:{args.probe}", args.seq, opts["ac"], args.precision)
                if steps and run["planner_probe"].get("tokens_per_s"):
                    run["measured_over_probe_predicted"] = run["tokens_per_s"] / run["planner_probe"]["tokens_per_s"]
            if steps and predicted.get("tokens_per_s"):
                run["measured_over_predicted"] = run["tokens_per_s"] / predicted["tokens_per_s"]
            result["runs"].append(run)
            out.write_text(json.dumps(result, indent=2))  # after every run: a cut-off check keeps what it measured
            pred = predicted.get("tokens_per_s")
            print(f"{name:24s} " + (f"error: {run['error']}" if "error" in run else
                  f"{run.get('tokens_per_s', 0):10,.0f} tok/s  MFU {100 * run.get('mfu', 0):5.1f}%  "
                  f"peak {run.get('peak_mem_gib', 0):6.1f} GiB  planner {pred or 0:10,.0f} tok/s "
                  f"(measured/predicted {run.get('measured_over_predicted', float('nan')):.2f})"), flush=True)
    return 0 if all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
