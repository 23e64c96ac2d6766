"""The planner against real `hardy train` runs on this machine (peak memory within ±15%)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from hardy.plan.check import check_run, probe_threads
from hardy.plan.hardware import get_hardware
from trainutil import launch

SIZES = {"micro": ["model.preset=micro", "data.seq_len=256", "train.micro_batch=64"],
         "tiny": ["model.preset=tiny", "data.seq_len=256", "train.micro_batch=32"],
         "smollm2-sized": ["model.preset=smollm2-135m", "data.seq_len=64", "train.micro_batch=2"]}
LAYOUTS = {"single": (1, []), "ddp2": (2, []), "fsdp2": (2, ["parallel.dp_shard=2"])}
# Every size, and every layout with activation checkpointing on and off, in seven runs. micro runs at
# micro-batch 64 (~250 MiB peak): at 16 its ~73 MiB peak was within the ±25 MiB run-to-run noise of
# lazily initialized runtime memory (BENCHMARKS.md), which once put a correct prediction 18% off; for
# the same reason micro with checkpointing is left out.
RUNS = [("micro", "single", "none"), ("micro", "ddp2", "none"), ("tiny", "fsdp2", "full"), ("tiny", "single", "full"),
        ("smollm2-sized", "single", "full"), ("smollm2-sized", "fsdp2", "none"), ("smollm2-sized", "ddp2", "full")]


@pytest.mark.parametrize("size, layout, ac", RUNS, ids=lambda v: str(v))
def test_predicted_peak_memory_within_15_percent(tmp_path, micro_dataset, probe_profile, size, layout, ac):
    nproc, sets = LAYOUTS[layout]
    run = tmp_path / "run"
    # release_memory: freed blocks go back to the OS, so RSS follows live memory (see docs/planner.md)
    # Two steps reach the peak (the optimizer's state appears in the first); one process may use both cores.
    launch(run, micro_dataset, nproc, *SIZES[size], *sets, "train.steps=2", f"train.activation_checkpoint={ac}",
           "train.release_memory=true", "checkpoint.at_end=false", threads=2 if nproc == 1 else 1)
    spec = f"probe:{probe_profile}"
    checked = check_run(run, get_hardware(spec), probe_threads(spec))
    plan, (name, predicted, measured, _) = checked.plan, checked.rows[0]
    assert name == "peak memory per process"
    assert predicted == pytest.approx(measured, rel=0.15), (
        f"{size} {layout} ac={ac}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB; "
        f"{ {k: round(v / 2**20, 1) for k, v in plan.memory.items()} }")
    if size == "micro" and layout == "single":
        proc = subprocess.run([sys.executable, "-m", "hardy", "plan", "check", str(run), "--hardware", spec, "--json"],
                              capture_output=True, text=True, cwd=REPO, timeout=120)
        assert proc.returncode == 0, proc.stderr
        quantities = {r["quantity"] for r in json.loads(proc.stdout)}
        assert {"peak memory per process", "step time", "tokens/s"} <= quantities
        # a run killed in the middle of writing a line: the check reads the whole lines, as before
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"event": "step", "step": 3, "loss": 2.')
        again = subprocess.run([sys.executable, "-m", "hardy", "plan", "check", str(run), "--hardware", spec, "--json"],
                               capture_output=True, text=True, cwd=REPO, timeout=120)
        assert again.returncode == 0, again.stderr
        assert [r["measured"] for r in json.loads(again.stdout)] == [r["measured"] for r in json.loads(proc.stdout)]


def test_check_refuses_what_is_not_a_run(tmp_path, probe_profile):
    proc = subprocess.run([sys.executable, "-m", "hardy", "plan", "check", str(tmp_path), "--hardware",
                           f"probe:{probe_profile}"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "not a hardy run directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
