"""`hardy plan check RUN_DIR`: the planner's prediction for a finished `hardy train` run next to
what the run measured — peak memory, step time, tokens/s, checkpoint stall — on the probe profile
of the machine that ran it."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from hardy.errors import HardyError
from hardy.fsio import read_json_lines
from hardy.model.config import ModelConfig
from hardy.plan.arch import arch_from_llama
from hardy.plan.hardware import Hardware
from hardy.plan.train import TrainJob, TrainPlan, plan_train


def read_run(run_dir: Path) -> tuple[dict, list[dict]]:
    run_dir = Path(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError as e:
        raise HardyError(f"{run_dir} is not a hardy run directory (missing {Path(e.filename).name})") from None
    except (OSError, ValueError) as e:
        raise HardyError(f"{run_dir}: unreadable run files ({e})") from None
    if not (run_dir / "metrics.jsonl").is_file():
        raise HardyError(f"{run_dir} is not a hardy run directory (missing metrics.jsonl)")
    events = read_json_lines(run_dir / "metrics.jsonl")
    if "resolved" not in config:
        raise HardyError(f"{run_dir}/config.json has no resolved section (not written by hardy train)")
    return config, events


def run_hardware(machine: Hardware, world: int, threads: int, probe_threads: int) -> Hardware:
    """One training process's share of the probed machine: its threads' share of the FLOP/s and
    bandwidth (the probe used `probe_threads`), its share of RAM."""
    share = min(1.0, threads / max(1, probe_threads)) if threads else 1.0 / world
    return machine.split(world, share, name=f"{machine.name} ({world} proc x {threads or 'all'} threads)")


def job_for_run(config: dict, hw: Hardware, restart_s: float = 300.0) -> TrainJob:
    resolved = config["resolved"]
    arch = arch_from_llama(ModelConfig.from_dict(resolved["model"]))
    world = int(resolved["world_size"])
    par, train = config["parallel"], config["train"]
    tp, dp_shard = int(par["tp"]), int(par["dp_shard"])
    dp = world // tp
    zero = 0 if dp_shard <= 1 else (3 if par.get("reshard_after_forward", True) else 2)
    seq = int(config["data"]["seq_len"])
    batch_tokens = seq * int(train["micro_batch"]) * int(train["grad_accum"]) * dp
    return TrainJob(arch=arch, hw=hw, devices=world, seq=seq, global_batch_tokens=batch_tokens, tp=tp, dp=dp,
                    zero=zero, ac=train["activation_checkpoint"], micro_batch=int(train["micro_batch"]),
                    precision=config["precision"]["dtype"], restart_s=restart_s, persistent_grads=False,
                    device_mtbf_hours=config.get("checkpoint", {}).get("device_mtbf_hours"))


class CheckRow(NamedTuple):
    quantity: str
    predicted: float
    measured: float
    unit: str


@dataclass
class RunCheck:
    plan: TrainPlan
    rows: list[CheckRow]


def check_run(run_dir: Path, machine: Hardware, probe_threads: int) -> RunCheck:
    """The planner's prediction for one run, and each quantity predicted next to its measurement."""
    config, events = read_run(run_dir)
    steps = [e for e in events if e.get("event") == "step" and not e.get("skipped")]
    if not steps:
        raise HardyError(f"{run_dir}: the run has no completed steps to compare with")
    world, threads = int(config["resolved"]["world_size"]), int(config["train"].get("threads") or 0)
    plan = plan_train(job_for_run(config, run_hardware(machine, world, threads, probe_threads)))
    timed = steps[1:] or steps  # the first step pays one-time costs (allocations, lazy init)
    measured_step = statistics.median(e["step_time_s"] for e in timed)
    rows = [CheckRow("peak memory per process", plan.peak_memory, max(e["peak_mem_bytes"] for e in steps), "bytes"),
            CheckRow("step time", plan.step_s, measured_step, "s"),
            CheckRow("tokens/s", plan.tokens_per_s, statistics.median(e["tokens_per_s"] for e in timed), "tokens/s")]
    saves = [e["stall_s"] for e in events if e.get("event") == "checkpoint"]
    if saves:
        rows.append(CheckRow("checkpoint stall", plan.reliability["checkpoint_stall_s"], statistics.median(saves), "s"))
    return RunCheck(plan, rows)


def probe_threads(spec: str) -> int:
    """Threads the probe measured with (a catalogue entry: its cores)."""
    if spec.startswith("probe:"):
        try:
            return int(json.loads(Path(spec[len("probe:"):]).read_text()).get("threads") or 1)
        except (OSError, ValueError):
            return 1
    return 1
