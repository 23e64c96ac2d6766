"""Fault-tolerance benchmarks.

  ckpt      checkpoint save throughput vs the disk's measured write bandwidth, and the training
            stall of an asynchronous save vs a synchronous one (SmolLM2-135M weights + AdamW state)
  recovery  time from a SIGKILL to the next completed step (hardy launch restarts the job)
  goodput   goodput of a run with seeded random failures next to the Young/Daly prediction

    .venv/bin/python bench/fault_bench.py ckpt
    .venv/bin/python bench/fault_bench.py recovery
    .venv/bin/python bench/fault_bench.py goodput --steps 300 --rate 0.01
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def disk_write_bandwidth(directory: Path, size: int = 1 << 30) -> float:
    block = os.urandom(1 << 24)
    path = directory / "bw.tmp"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return size / dt


def bench_ckpt(args) -> None:
    import torch

    from hardy.checkpoint.manager import CheckpointManager
    from hardy.model.config import get_preset
    from hardy.model.transformer import build_model

    root = Path(tempfile.mkdtemp(prefix="hardy-ckpt-", dir=args.dir))
    config = get_preset("smollm2-135m")
    model = build_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates the Adam moments: the full training state
    nbytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    bw = disk_write_bandwidth(root)
    mgr = CheckpointManager(root, keep=2, rank=0, device=torch.device("cpu"))
    tokens = torch.randint(0, config.vocab_size, (1, 128))
    sync, stall, total = [], [], []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        mgr.save(2 * i + 1, model, opt, {"step": 2 * i + 1}, {})
        sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mgr.save(2 * i + 2, model, opt, {"step": 2 * i + 2}, {}, asynchronous=True)
        stall_s = time.perf_counter() - t0
        model(tokens, targets=tokens).backward()  # training goes on while the state is staged
        t1 = time.perf_counter()
        mgr.staged()  # the trainer waits for the staging copy before its optimizer step
        stall_s += time.perf_counter() - t1
        while not mgr._pending[3].done():  # training goes on while it is written and hashed
            time.sleep(0.01)
        total.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        assert mgr.poll() is not None  # on the training thread: merge checksums, rename, COMPLETE
        stall.append(stall_s + time.perf_counter() - t1)
    s, a, t = statistics.median(sync), statistics.median(stall), statistics.median(total)
    print(f"SmolLM2-135M training state (weights + AdamW moments): {nbytes / 1e9:.2f} GB, {args.repeats} saves each")
    print(f"  disk write bandwidth (1 GiB, fsync):      {bw / 1e9:6.2f} GB/s")
    print(f"  synchronous save (DCP + manifest):        {s:6.2f} s  = {nbytes / s / 1e9:5.2f} GB/s "
          f"({100 * nbytes / s / bw:.0f}% of the disk)")
    print(f"  asynchronous save, training stall:        {a:6.2f} s  = {100 * a / s:.1f}% of the synchronous stall")
    print("    (blocked time on the training thread: the save call, the wait for the staging copy before the")
    print("     next optimizer step (one forward/backward of 128 tokens runs meanwhile), the poll that completes it)")
    print(f"  asynchronous save, until COMPLETE:        {t:6.2f} s")


def _launch(run_dir: Path, data: Path, sets: list[str], restarts: int) -> None:
    empty = run_dir.parent / "empty.toml"
    empty.write_text("")
    cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", "1", "--max-restarts", str(restarts),
           "--run-dir", str(run_dir), str(empty)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])


def _dataset(root: Path) -> Path:
    data = root / "data"
    if not (data / "index.json").exists():
        subprocess.run([sys.executable, "-m", "hardy", "data", "prepare", "--input", "tinyshakespeare",
                        "--tokenizer", "bpe:8192", "--out", str(data)], check=True, capture_output=True, cwd=REPO)
    return data


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


BASE = ["model.preset=tiny", "data.seq_len=256", "train.micro_batch=8", "train.threads=2", "log.progress=false",
        "train.deterministic=false", "fault.startup_timeout_s=120", "fault.hang_timeout_s=120"]


def bench_recovery(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="hardy-recovery-", dir=args.dir))
    data = _dataset(root)
    times = []
    for i in range(args.repeats):
        run = root / f"run{i}"
        _launch(run, data, BASE + [f"data.path={data}", "train.steps=30", "checkpoint.interval=10",
                                   'fault.inject="kill@25"'], restarts=1)
        ev = _events(run)
        second = [j for j, e in enumerate(ev) if e["event"] == "start"][1]
        last_before = ev[second - 1]["time"]
        first_step = next(e for e in ev[second:] if e["event"] == "step")
        times.append((first_step["time"] - last_before, first_step["time"] - first_step["step_time_s"] - last_before))
    print(f"recovery from SIGKILL at step 25 (checkpoint at step 20), tiny preset, 1 process, {args.repeats} runs:")
    print(f"  kill -> next completed step: median {statistics.median(t for t, _ in times):.2f} s "
          f"(runs: {', '.join(f'{t:.2f}' for t, _ in times)})")
    print(f"  of which restart (detect, relaunch, imports, rendezvous, checkpoint load): median "
          f"{statistics.median(r for _, r in times):.2f} s; the 5 steps since the checkpoint are then recomputed")


def bench_goodput(args) -> None:
    from hardy.fault.policy import expected_goodput, expected_goodput_step_failures

    root = Path(tempfile.mkdtemp(prefix="hardy-goodput-", dir=args.dir))
    data = _dataset(root)
    # Calibrate: step time and checkpoint stall without failures.
    calib = root / "calib"
    _launch(calib, data, BASE + [f"data.path={data}", "train.steps=20", "checkpoint.interval=5",
                                 "checkpoint.at_end=false"], restarts=0)
    ev = _events(calib)
    step_s = statistics.median(e["step_time_s"] for e in ev if e["event"] == "step")
    delta = statistics.median(e["stall_s"] for e in ev if e["event"] == "checkpoint")
    mtbf_s = step_s / args.rate  # a failure with probability `rate` after each step
    run = root / "failing"
    _launch(run, data, BASE + [f"data.path={data}", f"train.steps={args.steps}", "checkpoint.interval=auto",
                               f"checkpoint.device_mtbf_hours={mtbf_s / 3600}", f"fault.random_kill_rate={args.rate}",
                               f"fault.random_seed={args.seed}", "checkpoint.keep=2"], restarts=100)
    summary = json.loads((run / "summary.json").read_text())
    g = summary["goodput"]
    ev = _events(run)
    # The failure rate is per step: the MTBF the run actually had comes from its own step time
    # (the calibration's can differ on a shared machine).
    step_s = statistics.median(e["step_time_s"] for e in ev if e["event"] == "step")
    mtbf_s = step_s / args.rate
    saves = [e for e in ev if e["event"] == "checkpoint"]
    restart_s = g["losses_s"]["restarts"] / max(1, g["restarts"])
    steps_between = statistics.median(b["step"] - a["step"] for a, b in zip(saves, saves[1:])) if len(saves) > 1 else 0
    interval_s = steps_between * step_s  # compute between checkpoints
    stall = statistics.median(e["stall_s"] for e in saves) if saves else delta
    predicted = expected_goodput(interval_s, stall, mtbf_s, restart_s)
    predicted_steps = expected_goodput_step_failures(interval_s, stall, mtbf_s, restart_s)
    # The wall-clock MTBF that actually happened (failures / wall time) for reference.
    print(f"tiny preset, {args.steps} steps, failure probability {args.rate} per step (seed {args.seed}): "
          f"median step {step_s:.3f} s -> MTBF {mtbf_s:.1f} s")
    print(f"  failures: {g['restarts']}, checkpoints: {len(saves)} (auto interval: every {steps_between} steps "
          f"= {interval_s:.2f} s), stall {stall:.3f} s, restart {restart_s:.2f} s each")
    print(f"  measured goodput  {100 * g['goodput']:5.1f}%   (wall {g['wall_s']:.1f} s, useful {g['useful_s']:.1f} s)")
    print(f"  Young/Daly first-order prediction 1 - d/T - (T/2 + R)/M = {100 * predicted:5.1f}%   "
          f"difference {100 * (g['goodput'] - predicted):+.1f} points")
    print(f"  same, failures only during steps (as injected) 1/(1 + d/T + (T/2 + R)/(M - T/2)) = "
          f"{100 * predicted_steps:5.1f}%   difference {100 * (g['goodput'] - predicted_steps):+.1f} points")
    for key, value in g["losses_s"].items():
        print(f"    lost to {key:<12} {value:7.1f} s")
    planner_goodput(run, root, restart_s, mtbf_s, g["goodput"])


def planner_goodput(run: Path, root: Path, restart_s: float, mtbf_s: float, measured: float) -> None:
    """`hardy plan`'s own prediction for the same job: its checkpoint stall (bytes ÷ the probed disk
    bandwidth), its Daly interval and goodput, with the injected MTBF and the measured restart time."""
    from hardy.plan.check import job_for_run, probe_threads, read_run, run_hardware
    from hardy.plan.hardware import get_hardware
    from hardy.plan.train import plan_train

    profile = root / "probe.json"
    subprocess.run([sys.executable, "-m", "hardy", "probe", "--quick", "--out", str(profile), "--dir", str(root)],
                   check=True, capture_output=True, cwd=REPO)
    spec = f"probe:{profile}"
    config, _ = read_run(run)
    threads = int(config["train"]["threads"] or 0)
    job = job_for_run(config, run_hardware(get_hardware(spec), 1, threads, probe_threads(spec)), restart_s=restart_s)
    plan = plan_train(dataclasses.replace(job, device_mtbf_hours=mtbf_s / 3600))
    r = plan.reliability
    print(f"  hardy plan: stall {r['checkpoint_stall_s']:.3f} s, Daly interval {r['interval_s']:.2f} s, goodput "
          f"{100 * r['goodput']:5.1f}%   difference {100 * (measured - r['goodput']):+.1f} points")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["ckpt", "recovery", "goodput"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rate", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = ap.parse_args()
    {"ckpt": bench_ckpt, "recovery": bench_recovery, "goodput": bench_goodput}[args.what](args)


if __name__ == "__main__":
    main()
