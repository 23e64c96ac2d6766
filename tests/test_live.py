"""Live recovery on torchft (fault.recovery = "live"): replica groups that keep going through kills,
hangs and joins, and exact mode's bitwise equality with a fault-free run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from trainutil import BASE, _empty_config, assert_bitwise_equal

from hardy.errors import HardyError
from hardy.fault.live import combine_slot_rows, plan_slots

LIVE = ["fault.recovery=live", "checkpoint.interval=0", "checkpoint.at_end=true", "log.every=1000"]


def live_command(run_dir: Path, dataset: Path, nproc: int, *sets: str, max_restarts: int = 2) -> list[str]:
    overrides = [*BASE, f"data.path={dataset}", "train.threads=1", *LIVE, *sets]
    return [sys.executable, "-m", "hardy", "launch", "--nproc", str(nproc), "--max-restarts", str(max_restarts),
            "--run-dir", str(run_dir), _empty_config(run_dir.parent), *[a for s in overrides for a in ("--set", s)]]


def run_live(run_dir: Path, dataset: Path, nproc: int, *sets: str, timeout: float = 240) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(live_command(run_dir, dataset, nproc, *sets), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def events(run_dir: Path, group: int, kind: str) -> list[dict]:
    path = run_dir / f"replica_{group}" / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == kind]


def test_the_slots_of_a_step_cover_the_batch_once_in_exact_mode_and_drop_the_missing_share_in_fast_mode():
    # exact: 2 of 3 groups left compute all 3 shares between them, each once
    shares = [plan_slots(3, 2, rank, exact=True)[0] for rank in range(2)]
    assert sorted(s for mine in shares for s in mine) == [0, 1, 2] and shares[0] == (0, 2)
    assert plan_slots(3, 1, 0, exact=True) == ((0, 1, 2), (0, 1, 2))
    # fast: each participant its own share; the missing group's is not computed
    assert plan_slots(3, 2, 1, exact=False) == ((1,), (0, 1))
    # a spare (4th participant) computes nothing while the 3 groups are up, and stays in step
    assert plan_slots(3, 4, 3, exact=True)[0] == () and plan_slots(3, 4, 3, exact=False) == ((), (0, 1, 2))


def test_slot_rows_are_combined_in_slot_order_whatever_the_sum_order_of_the_all_reduce():
    torch.manual_seed(0)
    rows = torch.randn(3, 1000) * torch.tensor([[1e-3], [1.0], [1e3]])
    expected = ((rows[0] + rows[1]) + rows[2]) / 3
    assert torch.equal(combine_slot_rows(rows, (0, 1, 2)), expected)
    # zeros added by the groups that did not compute a row leave it exact (what the all-reduce does)
    padded = rows.clone()
    for _ in range(2):
        padded = padded + torch.zeros_like(padded)
    assert torch.equal(combine_slot_rows(padded, (0, 1, 2)), expected)
    # and the order matters: summed the other way round, these rows give other bits
    assert not torch.equal(expected, ((rows[2] + rows[1]) + rows[0]) / 3)


def test_live_options_are_checked_before_any_process_starts(tmp_path, micro_dataset):
    from hardy.train.config import load_config

    with pytest.raises(HardyError, match="need fault.recovery = live"):
        load_config(None, ["fault.exact=true"])
    with pytest.raises(HardyError, match="fault.recovery must be restart or live"):
        load_config(None, ["fault.recovery=elastic"])
    proc = subprocess.run(live_command(tmp_path / "run", micro_dataset, 2, "parallel.dp_replicate=1",
                                       "parallel.dp_shard=2"), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "needs parallel.dp_replicate >= 2" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(500)
def test_exact_mode_through_kills_and_a_whole_job_failure_equals_the_fault_free_run_bitwise(tmp_path, micro_dataset):
    sets = ["parallel.dp_replicate=3", "fault.exact=true", "train.steps=200"]
    final = "checkpoints/step_00000200"
    run_live(tmp_path / "clean", micro_dataset, 3, *sets)
    assert len(events(tmp_path / "clean", 0, "live_quorum")) == 1  # no churn: one quorum, all three groups

    # one group dies inside step 20 (its peers are in the all-reduce), another after step 40
    churn = tmp_path / "churn"
    out = run_live(churn, micro_dataset, 3, *sets, "fault.inject=kill_mid_step@20@rank1,kill@40@rank2")
    assert_bitwise_equal(tmp_path / "clean" / final, churn / final)
    quorums = [e["participants"] for e in events(churn, 0, "live_quorum")]
    assert quorums[0] == 3 and min(quorums) == 1 and quorums[-1] == 3, quorums
    assert [e["step"] for e in events(churn, 0, "live_retry")] == [20]  # computed again without the dead group
    assert events(churn, 1, "live_heal") and events(churn, 2, "live_heal")  # both came back from a live peer
    assert "the others compute its share (exact)" in out

    # every group dies after step 30: the first back find no live peer, say so and resume from the newest
    # checkpoint (step 20), never from step 1; a group back later heals from them
    whole = tmp_path / "whole"
    out = run_live(whole, micro_dataset, 3, *sets, "checkpoint.interval=10",
                   "fault.inject=kill@30@rank0,kill@30@rank1,kill@30@rank2")
    fallbacks = [events(whole, group, "live_fallback") for group in range(3)]
    assert any(fallbacks) and "no live peer ahead of it; resumed from checkpoint step_00000020" in out
    for group, fallback in enumerate(fallbacks):
        assert fallback or events(whole, group, "live_heal"), group
        assert all(f["step"] == 20 and f["checkpoint"].endswith("step_00000020") for f in fallback), fallback
        assert [e["step"] for e in events(whole, group, "start")][1] >= 20  # the restart did not begin again
    assert_bitwise_equal(tmp_path / "clean" / final, whole / final)
