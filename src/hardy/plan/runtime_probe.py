"""The probe's training step: real 3-step `hardy train` runs of the `micro` preset (1 process, then 2)
against the planner's tensor memory, giving the runtime overhead the planner adds (allocator pools,
thread stacks, library workspaces, gloo). In plan/ because it runs the planner; `hardy probe` hands it
to the probe."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hardy.data.prepare import prepare
from hardy.data.text import resolve_text_path
from hardy.plan.check import job_for_run, read_run
from hardy.plan.hardware import hardware_from_dict
from hardy.plan.train import plan_train


def measure_training_runtime(directory: Path) -> dict:
    """Memory a `hardy train` process holds beyond its tensors (allocator pools, thread stacks,
    library workspaces, the data loader; with 2 processes also gloo and DDP): 3-step runs of the
    `micro` preset, whose tensors the planner predicts, in child processes (1 process, then 2)."""
    nominal = hardware_from_dict("nominal-cpu", {  # memory does not depend on the speeds
        "kind": "cpu", "peak_tflops": {"fp32": 1.0}, "memory_gb": 1000, "bandwidth_gbs": 10, "flops_efficiency": 1,
        "bandwidth_efficiency": 1, "devices_per_node": 2, "intra_node": {"name": "-", "bandwidth_gbs": 1,
                                                                        "latency_us": 1},
        "inter_node": {"name": "-", "bandwidth_gbs": 1, "latency_us": 1}})
    out = {"model": "micro", "seq": 64, "micro_batch": 4, "threads": 1}
    with tempfile.TemporaryDirectory(prefix="hardy-probe-", dir=directory) as tmp:
        tmp = Path(tmp)
        text = tmp / "text.txt"
        text.write_text(resolve_text_path("tinyshakespeare").read_text()[:60_000])
        prepare([str(text)], "bpe:512", tmp / "data", seed=0)
        (tmp / "empty.toml").write_text("")
        sets = ["model.preset=micro", f"data.path={tmp / 'data'}", "data.seq_len=64", "train.micro_batch=4",
                "train.steps=3", "train.threads=1", "log.progress=false", "checkpoint.at_end=false",
                "checkpoint.interval=0", "optim.warmup_steps=1", "train.release_memory=true"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for nproc, key in ((1, "runtime_overhead_bytes"), (2, "distributed_runtime_overhead_bytes")):
            run = tmp / f"run{nproc}"
            launch = ["train"] if nproc == 1 else ["launch", "--nproc", "2"]
            cmd = [sys.executable, "-m", "hardy", *launch, "--run-dir", str(run), str(tmp / "empty.toml")]
            cmd += [a for s in sets for a in ("--set", s)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
            if proc.returncode != 0:
                out["error"] = (proc.stderr.strip().splitlines() or ["hardy train failed"])[-1]
                out.setdefault("runtime_overhead_bytes", 0.0)
                break
            config, events = read_run(run)
            peak = max(e["peak_mem_bytes"] for e in events if e.get("event") == "step")
            tensors = plan_train(job_for_run(config, nominal)).peak_memory
            out[f"peak_bytes_{nproc}proc"] = peak
            out[f"predicted_tensor_bytes_{nproc}proc"] = tensors
            out[key] = max(0.0, peak - tensors)
    return out
