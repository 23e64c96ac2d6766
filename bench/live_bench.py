"""Live recovery against checkpoint-restart and torchft's own defaults (issue 39's goals).

One job: 3 replica groups x 2 processes (FSDP inside each), the micro model on the bundled Shakespeare
slice, 150 steps; in every variant but `clean` one group is SIGKILLed after steps 30, 70 and 110 (a
different group each time). Variants, run alternately, --reps times each:

  clean      live recovery, exact mode, no failure: the reference wall time and final model
  live       live recovery, exact mode (hardy's settings: 0.3 s heartbeat timeout, 2 s all-reduce timeout)
  spare      the same with one warm spare group (8 processes)
  torchft    live recovery with torchft's own defaults (5 s heartbeat timeout, 0.1 s join timeout, 60 s
             timeout), fast mode
  restart    checkpoint-restart: the whole job restarts from the newest checkpoint (every 10 steps)

Per kill: the survivors' stall (their next step's time beyond the median step) and, with a spare, the
time from the kill to the spare's first committed step computing the lost share; per run: goodput
(clean wall / this wall) and whether the final model equals the clean run's bitwise.

    .venv/bin/python bench/live_bench.py --reps 5 --json /tmp/live.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
from native import median_ci  # noqa: E402

from hardy.fault.goodput import read_events  # noqa: E402

KILL_STEPS = (30, 70, 110)
KILLS = "kill@30@rank2,kill@70@rank4,kill@110@rank0"  # groups 1, 2, 0
BASE = ["model.preset=micro", "data.seq_len=64", "train.micro_batch=4", "train.steps=150", "optim.warmup_steps=2",
        "log.progress=false", "log.every=1000", "train.threads=1", "checkpoint.at_end=true",
        "parallel.dp_replicate=3", "parallel.dp_shard=2"]
VARIANTS = {
    "clean": ["fault.recovery=live", "fault.exact=true", "checkpoint.interval=0"],
    "live": ["fault.recovery=live", "fault.exact=true", "checkpoint.interval=0", f"fault.inject={KILLS}"],
    "spare": ["fault.recovery=live", "fault.exact=true", "checkpoint.interval=0", "fault.spares=1",
              f"fault.inject={KILLS}"],
    "torchft": ["fault.recovery=live", "fault.heartbeat_timeout_ms=5000", "fault.live_timeout_s=60",
                "fault.join_timeout_s=0.1",
                "checkpoint.interval=0", f"fault.inject={KILLS}"],
    "restart": ["checkpoint.interval=10", f"fault.inject={KILLS}"],
}


def dataset(root: Path) -> Path:
    from hardy.data.prepare import prepare
    from hardy.data.text import resolve_text_path

    text = root / "shakespeare.txt"
    text.write_text(resolve_text_path("tinyshakespeare").read_text()[:200_000])
    prepare([str(text)], "bpe:512", root / "ds", seed=0)
    return root / "ds"


def run(variant: str, run_dir: Path, data: Path) -> float:
    (run_dir.parent / "empty.toml").write_text("# every value comes from --set\n")
    sets = [*BASE, f"data.path={data}", *VARIANTS[variant]]
    cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", "6", "--max-restarts", "3", "--run-dir", str(run_dir),
           str(run_dir.parent / "empty.toml"), *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{variant} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return wall


def step_times(run_dir: Path, group: int | None) -> dict[int, dict]:
    """Step number -> the last step record of that step (a restarted job logs a step again)."""
    events = read_events(run_dir if group is None else run_dir / f"replica_{group}")
    return {r["step"]: r for r in events if r["event"] == "step"}


def kill_measures(variant: str, run_dir: Path) -> list[dict]:
    out = []
    victims = (1, 2, 0)
    for step, victim in zip(KILL_STEPS, victims):
        if variant == "restart":
            continue  # restart_measures: the kills are read from the restarts
        # a group that stepped through it (another may itself be restarting)
        steps = next((s for s in (step_times(run_dir, g) for g in (0, 1, 2, 3) if g != victim)
                      if step in s and step + 1 in s), None)
        if steps is None:
            continue
        median = statistics.median(r["step_time_s"] for r in steps.values())
        m = {"step": step, "survivor_stall_s": steps[step + 1]["step_time_s"] - median}
        if variant == "spare":  # the spare's first step computing a share after the kill
            spare = step_times(run_dir, 3)
            first = min((s for s, r in spare.items() if s > step and r.get("own_slots")), default=None)
            if first is not None:
                m["spare_first_commit_s"] = spare[first]["time"] - steps[step]["time"]
        out.append(m)
    return out


def restart_measures(run_dir: Path) -> list[dict]:
    """Checkpoint-restart: per restart, the last step logged before it to the first after it (the steps
    redone from the checkpoint come on top, in the wall time)."""
    out, last, pending = [], None, None
    for r in read_events(run_dir):
        if r["event"] == "start" and last is not None:
            pending = last
        elif r["event"] == "step":
            if pending is not None:
                out.append({"step": pending["step"], "recovery_s": r["time"] - pending["time"],
                            "redone_steps": pending["step"] - r["step"] + 1})
                pending = None
            last = r
    return out


def same_model(a: Path, b: Path) -> bool:
    import torch

    from trainutil import training_state

    sa, sb = training_state(a), training_state(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="clean,live,spare,torchft,restart")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    root = Path(tempfile.mkdtemp(prefix="hardy-live-"))
    data = dataset(root)
    results = {v: [] for v in variants}
    final = "checkpoints/step_00000150"
    for rep in range(args.reps):
        for variant in variants:  # alternating: every variant sees the machine in the same states
            run_dir = root / f"{variant}-{rep}"
            wall = run(variant, run_dir, data)
            kills = restart_measures(run_dir) if variant == "restart" else \
                kill_measures(variant, run_dir) if variant != "clean" else []
            entry = {"wall_s": wall, "kills": kills}
            clean = root / f"clean-{rep}" / final
            if variant in ("live", "spare") and clean.exists():  # the exact-mode variants
                entry["bitwise_equal_to_clean"] = same_model(clean, run_dir / final)
            results[variant].append(entry)
            print(f"rep {rep} {variant}: {json.dumps(entry)}", flush=True)
            if variant != "clean":
                shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(root / f"clean-{rep}", ignore_errors=True)
    summary = summarize(results)
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=2))


def summarize(results: dict) -> dict:
    out = {}
    clean = [r["wall_s"] for r in results.get("clean", [])]
    for variant, runs in results.items():
        s = {"wall_s": median_ci([r["wall_s"] for r in runs])}
        if clean and variant != "clean":
            s["goodput"] = median_ci([c / r["wall_s"] for c, r in zip(clean, runs)])
        for key in ("survivor_stall_s", "spare_first_commit_s", "recovery_s"):
            values = [k[key] for r in runs for k in r["kills"] if key in k]
            if values:
                values.sort()
                s[key] = {"median_ci": median_ci(values), "p95": values[min(len(values) - 1,
                                                                           int(0.95 * len(values)))],
                          "n": len(values)}
        bitwise = [r["bitwise_equal_to_clean"] for r in runs if "bitwise_equal_to_clean" in r]
        if bitwise:
            s["bitwise_equal_runs"] = f"{sum(bitwise)}/{len(bitwise)}"
        out[variant] = s
    return out


if __name__ == "__main__":
    main()
