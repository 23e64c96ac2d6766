"""Planner vs measurement on this machine: `hardy train` runs of micro / tiny / a SmolLM2-sized model,
single process, DDP and FSDP2 on 2 processes, with and without activation checkpointing (fp32),
then `hardy plan check` on each with the probe profile measured in the same run.

    .venv/bin/python bench/plan_check_bench.py [--steps 4] [--dir /tmp] [--allocator both|release|default]

Goals (issue 5): peak memory within ±15% (with `train.release_memory`, where RSS tracks live
memory), step time within ±35%. With glibc's default allocator the RSS also holds freed heap
blocks; those runs are reported too, to show by how much.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = {"micro": ["model.preset=micro", "data.seq_len=256", "train.micro_batch=16"],
          "tiny": ["model.preset=tiny", "data.seq_len=256", "train.micro_batch=8"],
          "smollm2-sized": ["model.preset=smollm2-135m", "data.seq_len=128", "train.micro_batch=2"]}
LAYOUTS = {"single": (1, []), "ddp2": (2, []), "fsdp2": (2, ["parallel.dp_shard=2"])}


def hardy(*args, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hardy", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"hardy {' '.join(args[:3])} failed:\n{proc.stderr[-2000:]}")
    return proc


def dataset(root: Path) -> Path:
    from hardy.data.prepare import prepare
    from hardy.data.text import resolve_text_path

    text = root / "text.txt"
    text.write_text(resolve_text_path("tinyshakespeare").read_text()[:300_000])
    prepare([str(text)], "bpe:512", root / "data", seed=0)
    return root / "data"


def train(run: Path, data: Path, nproc: int, sets: list[str]) -> None:
    empty = run.parent / "empty.toml"
    empty.write_text("")
    args = [a for s in sets + [f"data.path={data}", "log.progress=false", "checkpoint.at_end=false"]
            for a in ("--set", s)]
    threads = 2 // nproc
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    args += ["--set", f"train.threads={threads}"]
    if nproc == 1:
        hardy("train", "--run-dir", str(run), str(empty), *args, env=env)
    else:
        hardy("launch", "--nproc", str(nproc), "--run-dir", str(run), str(empty), *args, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--allocator", default="both", choices=["both", "release", "default"])
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hardy-plancheck-", dir=args.dir))
    data = dataset(root)
    profile = root / "probe.json"
    hardy("probe", "--out", str(profile), "--dir", str(root))
    modes = {"both": [True, False], "release": [True], "default": [False]}[args.allocator]
    rows = []
    for release in modes:
        for model, model_sets in MODELS.items():
            for layout, (nproc, layout_sets) in LAYOUTS.items():
                for ac in ("none", "full"):
                    name = f"{model}-{layout}-ac_{ac}-{'release' if release else 'default'}"
                    run = root / name
                    train(run, data, nproc, model_sets + layout_sets + [
                        f"train.steps={args.steps}", f"train.activation_checkpoint={ac}",
                        f"train.release_memory={'true' if release else 'false'}"])
                    out = json.loads(hardy("plan", "check", str(run), "--hardware", f"probe:{profile}", "--json").stdout)
                    by = {r["quantity"]: r for r in out}
                    rows.append((name, by["peak memory per process"], by["step time"]))
                    m, t = by["peak memory per process"], by["step time"]
                    print(f"{name:42} memory {m['predicted'] / 2**20:8.1f} vs {m['measured'] / 2**20:8.1f} MiB "
                          f"({100 * m['error']:+6.1f}%)   step {t['predicted']:7.3f} vs {t['measured']:7.3f} s "
                          f"({100 * t['error']:+6.1f}%)", flush=True)
    print()
    for release in modes:
        tag = "release" if release else "default"
        sel = [r for r in rows if r[0].endswith(tag)]
        mem = [abs(r[1]["error"]) for r in sel]
        step = [abs(r[2]["error"]) for r in sel]
        print(f"allocator {tag:8}: memory |error| median {100 * statistics.median(mem):.1f}%, max {100 * max(mem):.1f}%, "
              f"within 15%: {sum(e <= 0.15 for e in mem)}/{len(mem)};  step |error| median "
              f"{100 * statistics.median(step):.1f}%, within 35%: {sum(e <= 0.35 for e in step)}/{len(step)}")
    print("(memory is the claim for release runs, where RSS tracks live memory; step time for default runs:")
    print(" release_memory adds page faults to every large allocation)")
    print(f"(runs and the probe profile are in {root})")


if __name__ == "__main__":
    main()
