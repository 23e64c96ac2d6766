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

import psutil
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
    proc = subprocess.run(live_command(tmp_path / "run", micro_dataset, 2, "parallel.dp_replicate=2",
                                       "checkpoint.memory_interval=5"), capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2 and "checkpoint.memory_interval is for restart recovery" in proc.stderr


@pytest.mark.timeout(500)
def test_exact_mode_through_kills_and_a_whole_job_failure_equals_the_fault_free_run_bitwise(tmp_path, micro_dataset):
    sets = ["parallel.dp_replicate=3", "fault.exact=true", "train.steps=400"]  # long enough for both to return
    final = "checkpoints/step_00000400"
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


def _worker_pid(group: int) -> int | None:
    """The training process of replica group `group` (the one torchrun's agent started), if up."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ours = f"HARDY_REPLICA_GROUP={group}".encode() in env and b"LOCAL_RANK=0" in env
        if ours and b"torch.distributed.run" not in cmd:
            return int(entry.name)
    return None


def _wait_for(predicate, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(run_dir: Path, group: int) -> list[dict]:
    path = run_dir / f"replica_{group}" / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()[:-1]) if r["event"] == "step"]


@pytest.mark.timeout(300)
def test_a_hung_group_is_out_of_the_quorum_in_two_seconds_and_a_spare_takes_its_share(tmp_path, micro_dataset):
    run_dir = tmp_path / "run"
    cmd = live_command(run_dir, micro_dataset, 3, "parallel.dp_replicate=3", "fault.spares=1", "train.steps=600")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        _wait_for(lambda: len(_steps(run_dir, 0)) >= 20, 120, "step 20")
        pid = _worker_pid(1)
        os.kill(pid, signal.SIGSTOP)  # hung: no heartbeat, no all-reduce, its sockets open
        stopped = time.time()
        quorum = _wait_for(lambda: [e for e in events(run_dir, 0, "live_quorum") if e["time"] > stopped], 60,
                           "a quorum without the hung group")[0]
        # out after the all-reduce's timeout (fault.live_timeout_s = 2 s) and the heartbeat's (0.3 s)
        assert quorum["time"] - stopped <= 3.0, quorum["time"] - stopped
        # the spare took the hung group's share: three groups compute, the whole batch
        assert quorum["participants"] == 3 and quorum["slots"] == [0, 1, 2], quorum
        _wait_for(lambda: [s for s in _steps(run_dir, 0) if s["time"] > quorum["time"]], 30, "a step after it")
        time.sleep(1.0)
        os.kill(pid, signal.SIGCONT)  # back: its step fails, it finds itself behind and heals from a peer
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    assert [e for e in events(run_dir, 1, "live_heal") if e["time"] > stopped], out[-3000:]
    finals = {g: _steps(run_dir, g)[-1] for g in range(4)}
    assert {s["step"] for s in finals.values()} == {600}
    assert len({s["loss"] for s in finals.values()}) == 1  # every group, spare included, ends in the same state


@pytest.mark.timeout(400)
def test_the_documented_live_command_with_fsdp_groups_heals_both_kills_and_exports(tmp_path, micro_dataset):
    run_dir = tmp_path / "run"
    out = run_live(run_dir, micro_dataset, 6, "parallel.dp_replicate=3", "parallel.dp_shard=2", "fault.exact=true",
                   "train.steps=300", "fault.inject=kill@20@rank2,kill@45@rank4", timeout=360)
    assert "3 replica group(s) of 2 process(es)" in out
    for group in (1, 2):  # rank 2 is group 1's first process, rank 4 group 2's
        assert events(run_dir, group, "live_heal"), out[-4000:]
    assert events(run_dir, 0, "end")[0]["steps"] == 300 and not events(run_dir, 0, "live_fallback")
    export = subprocess.run([sys.executable, "-m", "hardy", "export", "--model", str(run_dir), "--format",
                             "safetensors", "--out", str(tmp_path / "export")], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert export.returncode == 0, export.stderr
    assert (tmp_path / "export" / "model.safetensors").is_file()


def slow_stop_record(where: Path, seconds: float) -> Path:
    """A folder for PYTHONPATH whose sitecustomize makes every process started with it write its stop
    record (preempted.json) `seconds` late, as a slow save or shared filesystem would."""
    where.mkdir(parents=True)
    (where / "sitecustomize.py").write_text(
        "import time\nimport hardy.fault.preempt as p\n_record = p.record_preemption\n"
        f"def _late(*a, **k):\n    time.sleep({seconds})\n    _record(*a, **k)\n"
        "p.record_preemption = _late\n")
    return where


def _since(run_dir: Path, group: int, kind: str, since: float) -> list[dict]:
    from hardy.fault.goodput import read_events  # skips a line still being written

    return [e for e in read_events(run_dir / f"replica_{group}") if e["event"] == kind and e["time"] > since]


@pytest.mark.timeout(400)
def test_groups_on_two_nodes_go_on_without_a_lost_node_and_heal_it_when_its_command_runs_again(
        tmp_path, micro_dataset):
    """Two launchers on loopback, `--nnodes 2 --node-rank R`, each node two groups of one process. Node 1
    (launcher, agents and workers) is SIGKILLed as a lost node; node 0's groups go on in a quorum of two;
    node 1's command run again brings its groups back, healed from a live peer; a SIGTERM to both launchers
    then stops every group after the same step."""
    from test_launch import end_all, free_port

    run_dir, port = tmp_path / "run", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # node 0 (whose group 0 writes the stop's checkpoint) records it 3 s late: node 1's launcher, whose groups
    # stop at once, must not report the stop before then (a race CI lost once)
    node0_env = dict(env, PYTHONPATH=os.pathsep.join([str(slow_stop_record(tmp_path / "slow", 3.0)),
                                                      *filter(None, [env.get("PYTHONPATH")])]))
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(3)]

    def node(rank: int, log) -> subprocess.Popen:
        cmd = live_command(run_dir, micro_dataset, 2, "parallel.dp_replicate=4", "train.steps=1000000")
        cmd += ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--node-rank", str(rank)]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env if rank else node0_env,
                                start_new_session=True)

    def log_tail(i: int) -> str:
        return (tmp_path / f"node{i}.log").read_text()[-3000:]

    nodes = [node(1, logs[1]), node(0, logs[0])]  # node 1 first: it waits for node 0's store
    try:
        _wait_for(lambda: len(_since(run_dir, 0, "step", 0)) >= 20 or nodes[1].poll() is not None, 180, "step 20")
        assert nodes[1].poll() is None, log_tail(0)
        assert _since(run_dir, 2, "step", 0) and _since(run_dir, 3, "step", 0)  # node 1's groups in the quorum
        lost = time.time()
        tree = psutil.Process(nodes[0].pid)
        for p in [tree, *tree.children(recursive=True)]:
            p.send_signal(signal.SIGKILL)
        nodes[0].wait(timeout=30)
        _wait_for(lambda: [e for e in _since(run_dir, 0, "live_quorum", lost) if e["participants"] == 2], 60,
                  "a quorum of node 0's two groups")
        nodes.append(node(1, logs[2]))  # the same command, on the node again
        _wait_for(lambda: _since(run_dir, 2, "live_heal", lost) and _since(run_dir, 3, "live_heal", lost), 180,
                  "node 1's groups healed")
        _wait_for(lambda: [e for e in _since(run_dir, 0, "live_quorum", lost) if e["participants"] == 4], 60,
                  "all four groups in the quorum again")
        for launcher in (nodes[1], nodes[2]):
            launcher.send_signal(signal.SIGTERM)
        assert nodes[1].wait(timeout=180) == 0, log_tail(0)
        assert nodes[2].wait(timeout=60) == 0, log_tail(2)
    finally:
        end_all(nodes, logs)
    assert "node 1 of 2 runs group(s) 2, 3 of 4 replica group(s)" in log_tail(2)
    stopped = json.loads((run_dir / "preempted.json").read_text())
    for g in (2, 3):
        assert (f"[group {g}] the quorum's first replica group checkpointed step {stopped['step']}: "
                f"{stopped['checkpoint']}") in log_tail(2)
    assert {g: _steps(run_dir, g)[-1]["step"] for g in range(4)} == dict.fromkeys(range(4), stopped["step"])


def test_a_live_launch_on_several_nodes_checks_its_node_options(tmp_path, micro_dataset, monkeypatch, capsys):
    cases = [(["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "0"], "takes a fixed --nnodes N"),
             (["--nnodes", "2", "--node-rank", "0"], "--nnodes needs --rdzv-endpoint"),
             (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "needs --node-rank 0..1"),
             (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "2"], "needs --node-rank 0..1"),
             (["--rdzv-endpoint", "127.0.0.1:1"], "go with --nnodes"),
             (["--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "0", "--set",
               "parallel.dp_shard=3"],  # 2 groups of 3 on 3 nodes x 2
              "a replica group (3 processes: dp_shard x tp) runs on one node: --nproc 2 must be a multiple of 3")]
    from hardy.cli.main import main

    monkeypatch.delenv("SLURM_NODEID", raising=False)
    for extra, message in cases:  # in this process: each is refused before any process or socket starts
        argv = live_command(tmp_path / "run", micro_dataset, 2, "parallel.dp_replicate=2")[3:] + extra
        assert main(argv) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not (tmp_path / "run").exists()


def test_group_straggler_windows_name_the_slow_group_and_act_after_k_windows():
    from hardy.fault.live import GroupStragglers

    watch = GroupStragglers(every=4, factor=1.5, act_after=2)
    step = [0.10, 0.31, 0.11, 0.0]  # group 1 three times slower; group 3 (a spare) not computing
    assert all(watch.observe(step) == ([], None) for _ in range(3))
    slow, act = watch.observe(step)
    assert [g for g, _ in slow] == [1] and act is None  # one window: named, not yet acted on
    for _ in range(3):
        watch.observe(step)
    slow, act = watch.observe(step)
    assert act == 1 and abs(slow[0][1] - 0.31 / 0.105) < 1e-9
    for _ in range(4):  # back to speed: the count starts again
        result = watch.observe([0.1, 0.1, 0.1, 0.0])
    assert result == ([], None) and watch.flagged == {}


def test_between_two_groups_the_slower_is_named_but_never_acted_on():
    from hardy.fault.live import GroupStragglers

    watch = GroupStragglers(every=2, factor=1.5, act_after=2)
    pair = [0.1, 0.0, 0.25]  # group 1 evicted earlier: two groups left, one 2.5x the other
    verdicts = [watch.observe(pair) for _ in range(8)][1::2]
    assert [v.slow for v in verdicts] == [[(2, 2.5)]] * 4 and watch.flagged == {2: 4}
    assert all(v.act is None for v in verdicts)
    trio = [0.1, 0.1, 0.25]  # a third group computing again: a majority sets the pace
    assert [watch.observe(trio).act for _ in range(2)] == [None, 2]


@pytest.mark.timeout(300)
def test_a_persistently_slow_group_is_evicted_and_the_others_finish(tmp_path, micro_dataset):
    run_dir = tmp_path / "run"
    out = run_live(run_dir, micro_dataset, 3, "parallel.dp_replicate=3", "train.steps=120",
                   "fault.inject=slow@rank1:4x", "health.straggler_every=10", "health.straggler_stop_after=2",
                   "health.straggler_action=evict")
    evicted = events(run_dir, 0, "straggler_evicted")
    assert [e["straggler_group"] for e in evicted] == [1], out[-3000:]
    assert "replica group 1 evicted" in out
    assert events(run_dir, 0, "end")[0]["steps"] == 120 and not events(run_dir, 1, "end")
    later = [e["participants"] for e in events(run_dir, 0, "live_quorum") if e["step"] > evicted[0]["step"]]
    assert later and later[-1] == 2  # it left; the two others went on


@pytest.mark.timeout(300)
def test_sigterm_to_the_live_launcher_checkpoints_every_group_at_one_step_and_the_same_command_resumes(
        tmp_path, micro_dataset):
    run_dir = tmp_path / "run"
    cmd = live_command(run_dir, micro_dataset, 3, "parallel.dp_replicate=3", "fault.exact=true", "train.steps=150")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    try:
        _wait_for(lambda: len(_steps(run_dir, 0)) >= 30, 120, "step 30")
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as a scheduler's notice would reach it
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    stopped = json.loads((run_dir / "preempted.json").read_text())
    assert 30 <= stopped["step"] < 150 and f"stopped after step {stopped['step']}" in out
    last = {g: _steps(run_dir, g)[-1]["step"] for g in range(3)}
    assert set(last.values()) == {stopped["step"]}, last  # every group stopped after the same step

    resumed = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    for g in range(3):
        starts = [e["step"] for e in events(run_dir, g, "start")]
        assert starts[-1] == stopped["step"] or events(run_dir, g, "live_heal"), (g, starts)
        assert _steps(run_dir, g)[-1]["step"] == 150
    assert not (run_dir / "preempted.json").exists()


@pytest.mark.timeout(300)
def test_random_kills_strike_any_group_and_it_comes_back_from_a_live_peer_or_the_final_checkpoint(
        tmp_path, micro_dataset):
    # seed 2116 at rate 0.003 draws one kill in 1200 steps: after step 8, global rank 1 (group 1 here)
    run_dir = tmp_path / "run"
    out = run_live(run_dir, micro_dataset, 3, "parallel.dp_replicate=3", "train.steps=800",
                   "fault.random_kill_rate=0.003", "fault.random_seed=2116")
    assert json.loads((run_dir / "replica_1" / "faults_fired.json").read_text()) == ["random_kill@8"]
    assert not (run_dir / "replica_0" / "faults_fired.json").exists()
    # the restarted group heals from a live peer; only when the others finished while it restarted (a loaded
    # machine) does it find no peer, and then it takes the final checkpoint, never step 0
    healed, fell_back = events(run_dir, 1, "live_heal"), events(run_dir, 1, "live_fallback")
    assert healed or [e["step"] for e in fell_back] == [800], (healed, fell_back)
    assert not fell_back or "[group 1] nothing left to train: step 800 is the last" in out
    assert len(events(run_dir, 1, "start")) == 2 and events(run_dir, 1, "end")[-1]["steps"] == 800
    assert events(run_dir, 0, "end")[0]["steps"] == 800, out[-3000:]


def test_a_run_resumed_at_its_last_step_says_nothing_was_left_rather_than_a_nan_loss():
    from hardy.train.trainer import RunSummary

    done = RunSummary(steps=800, final_loss=float("nan"), tokens=0, wall_s=0.0, tokens_per_s=0.0,
                      peak_mem_bytes=0, skipped_steps=0, checkpoint="ckpt/step_00000800")
    assert done.lines() == ["nothing left to train: step 800 is the last", "last checkpoint: ckpt/step_00000800"]
    trained = RunSummary(steps=10, final_loss=2.5, tokens=640, wall_s=1.0, tokens_per_s=640.0, peak_mem_bytes=2**20,
                         skipped_steps=0, checkpoint=None)
    assert trained.lines()[0].startswith("finished 10 steps in 1.0 s: final loss 2.5000, 640 tokens")
