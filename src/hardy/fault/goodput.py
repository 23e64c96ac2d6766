"""Goodput accounting from a run's event log (metrics.jsonl, appended across restarts).

goodput = useful step time / wall time, where a step's time is useful only if the step's result
survived (it was not skipped, recomputed after a crash, or undone by a rollback). The losses:
  restarts     downtime between a process's last event and the next process's first step
               (detection, teardown, relaunch, start-up, checkpoint load), minus hang detection
  hang_detect  time the watchdog waited before declaring a hang
  recomputed   steps that ran, were lost in a crash, and ran again
  rollbacks    steps undone by a loss-spike rollback
  skipped      steps skipped for non-finite loss/gradients
  checkpoints  time training stood still for checkpoint saves
  other        the rest: logging, evaluation, first-step warm-up not counted as a step, ...
"""
from __future__ import annotations

from pathlib import Path

from hardy.fsio import read_json_lines

LOSS_KEYS = ("restarts", "hang_detect", "recomputed", "rollbacks", "skipped", "checkpoints", "other")


def read_events(run_dir: Path) -> list[dict]:
    return read_json_lines(Path(run_dir) / "metrics.jsonl")


def hang_detect_time(run_dir: Path) -> float:
    total = 0.0
    for f in Path(run_dir).glob("hang_rank0.jsonl"):
        total += sum(e["detect_s"] for e in read_json_lines(f) if isinstance(e.get("detect_s"), (int, float)))
    return total


def _work(step_record: dict) -> float:
    """A step's time without its wait for an asynchronous checkpoint (counted under checkpoints)."""
    return step_record["step_time_s"] - step_record.get("ckpt_wait_s", 0.0)


def account(run_dir: Path, now: float | None = None) -> dict:
    events = read_events(run_dir)
    starts = [e for e in events if e.get("event") == "start"]
    if not starts:
        return {}
    latest: dict[int, dict] = {}
    boundary = None  # what happened since the last step record: "restart" or "rollback"
    losses = dict.fromkeys(LOSS_KEYS, 0.0)
    prev_time = None
    pending_restart = None
    for e in events:
        kind = e.get("event")
        if kind == "start":
            if prev_time is not None:
                pending_restart = prev_time
                boundary = "restart"
        elif kind == "rollback":
            boundary = "rollback"
        elif kind in ("checkpoint", "checkpoint_complete"):
            losses["checkpoints"] += e.get("stall_s", 0.0)
        elif kind == "step":
            losses["checkpoints"] += e.get("ckpt_wait_s", 0.0)  # waiting for an async save's staging copy
            if pending_restart is not None:
                losses["restarts"] += max(0.0, e["time"] - e["step_time_s"] - pending_restart)
                pending_restart = None
            old = latest.get(e["step"])
            if old is not None:
                key = "rollbacks" if boundary == "rollback" else "recomputed"
                losses["skipped" if old.get("skipped") else key] += _work(old)
            latest[e["step"]] = e
        if kind in ("start", "step", "checkpoint", "rollback", "end"):
            prev_time = e["time"]
    # steps undone by a rollback and never redone are still losses
    end_time = now if now is not None else prev_time
    wall = end_time - starts[0]["time"]
    useful = sum(_work(r) for r in latest.values() if not r.get("skipped"))
    losses["skipped"] += sum(_work(r) for r in latest.values() if r.get("skipped"))
    detect = hang_detect_time(run_dir)
    losses["hang_detect"] = detect
    losses["restarts"] = max(0.0, losses["restarts"] - detect)
    losses["other"] = max(0.0, wall - useful - sum(v for k, v in losses.items() if k != "other"))
    return {"goodput": useful / wall if wall > 0 else 0.0, "wall_s": wall, "useful_s": useful,
            "restarts": len(starts) - 1, "losses_s": losses}


def format_goodput(g: dict) -> list[str]:
    if not g:
        return []
    lines = [f"goodput {100 * g['goodput']:.1f}%: {g['useful_s']:.1f} s of useful steps in {g['wall_s']:.1f} s wall, "
             f"{g['restarts']} restart(s)"]
    for key, value in g["losses_s"].items():
        if value > 0:
            lines.append(f"  lost to {key:<12} {value:8.1f} s  ({100 * value / g['wall_s']:.1f}%)")
    return lines
