"""Multi-node launch: torchrun's c10d rendezvous with two launcher agents on loopback as two nodes, one
of them killed whole mid-run; and the Slurm script, run against stand-in Slurm commands."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, hardy_main
from hardy.checkpoint.manager import step_dirs
from hardy.errors import HardyError
from hardy.ops.launch import Launch, node_rank_of
from trainutil import BASE, _empty_config, assert_bitwise_equal, launch

STEPS = ("train.steps=12", "checkpoint.interval=4", "checkpoint.at_end=true", "checkpoint.keep=5",
         "fault.startup_timeout_s=60", "fault.hang_timeout_s=60")
# rank 1 burns 15x its compute each step (no effect on the numbers): time to kill a node mid-run
PACED = "fault.inject=slow@rank1:15x"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(run, dataset, port: int, node_rank: int, restarts: int, log) -> subprocess.Popen:
    sets = [*BASE, f"data.path={dataset}", "train.threads=1", *STEPS, PACED]
    (run.parent / "empty.toml").write_text("# every value comes from --set\n")
    cmd = [sys.executable, "-m", "hardy", "launch", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", "--node-rank", str(node_rank), "--max-restarts",
           str(restarts), "--run-dir", str(run), str(run.parent / "empty.toml"), *[a for s in sets for a in ("--set", s)]]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))


def end_all(launchers: list[subprocess.Popen], logs) -> None:
    """Kill what is still running (each launcher started in a session of its own) and close the logs."""
    for launcher in launchers:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    for log in logs:
        log.close()


def last_step(run) -> int:
    path = run / "metrics.jsonl"
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
             if '"event": "step"' in line] if path.exists() else []
    return max(steps, default=0)


def test_two_nodes_survive_the_loss_of_one_and_finish_bitwise_equal(tmp_path, micro_dataset):
    """Two `hardy launch` agents on loopback form one job (c10d rendezvous); agent 1 and its worker are
    SIGKILLed together after the step-4 checkpoint, as a lost node; a replacement agent joins, the
    group restarts from the newest checkpoint and the final parameters and optimizer state equal a
    one-node run's bit for bit."""
    baseline = tmp_path / "baseline"
    launch(baseline, micro_dataset, 2, *STEPS)
    run, port = tmp_path / "run", free_port()
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(3)]
    agents = [agent(run, micro_dataset, port, 0, 2, logs[0]), agent(run, micro_dataset, port, 1, 0, logs[1])]
    try:
        deadline = time.time() + 240
        while last_step(run) < 5 and time.time() < deadline and agents[0].poll() is None:
            time.sleep(0.2)
        assert 5 <= last_step(run) < 12, (tmp_path / "agent0.log").read_text()[-3000:]
        node = psutil.Process(agents[1].pid)
        for p in [node, *node.children(recursive=True)]:  # the whole node at once: agent and worker
            p.send_signal(signal.SIGKILL)
        agents[1].wait(timeout=30)
        agents.append(agent(run, micro_dataset, port, 1, 0, logs[2]))  # the replacement node
        assert agents[0].wait(timeout=300) == 0, (tmp_path / "agent0.log").read_text()[-3000:]
        assert agents[2].wait(timeout=60) == 0, (tmp_path / "agent2.log").read_text()[-3000:]
    finally:
        end_all(agents, logs)
    out = (tmp_path / "agent0.log").read_text() + (tmp_path / "agent2.log").read_text()
    assert "resumed from step_0000000" in out
    assert_bitwise_equal(run / "checkpoints" / "step_00000012", baseline / "checkpoints" / "step_00000012")


def test_sigterm_to_the_launcher_checkpoints_at_the_next_step_and_the_same_command_resumes(tmp_path, micro_dataset):
    """A preemption: SIGTERM to `hardy launch` alone reaches both workers through torchrun's agent; they
    agree on one step in the step's all-reduce, save it, and the launcher exits 0. The same command then
    resumes from that step and ends bitwise equal to a run that was never stopped."""
    sets = [*STEPS, "checkpoint.interval=100"]  # no periodic save: the stop's checkpoint is the only one
    baseline = tmp_path / "baseline"
    launch(baseline, micro_dataset, 2, *sets)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", "2", "--run-dir", str(run), _empty_config(tmp_path),
           *[a for s in [*BASE, f"data.path={micro_dataset}", "train.threads=1", *sets, PACED] for a in ("--set", s)]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            deadline = time.time() + 240
            while last_step(run) < 3 and time.time() < deadline and first.poll() is None:
                time.sleep(0.1)
            first.send_signal(signal.SIGTERM)  # the launcher only, as a scheduler's notice would reach it
            code = first.wait(timeout=120)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
    out = (tmp_path / "first.log").read_text()
    assert code == 0, out[-3000:]
    stopped = json.loads((run / "preempted.json").read_text())
    assert 3 <= stopped["step"] < 12 and stopped["signal"] == "SIGTERM", stopped
    assert f"SIGTERM: stopped after step {stopped['step']}" in out
    assert [step for step, _ in step_dirs(run / "checkpoints")] == [stopped["step"]]
    resumed = subprocess.run(cmd[:-2], capture_output=True, text=True, cwd=REPO, env=env, timeout=240)  # unpaced
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{stopped['step']:08d}" in resumed.stdout + resumed.stderr
    assert not (run / "preempted.json").exists()
    assert_bitwise_equal(run / "checkpoints" / "step_00000012", baseline / "checkpoints" / "step_00000012")


def test_a_stop_signal_to_one_worker_stops_every_rank_after_the_same_step(tmp_path, micro_dataset):
    """SIGUSR1 (Slurm's warning) reaching rank 1 alone: the flag travels in the step's all-reduce, so
    rank 0 stops after the same step, both save it, and the job ends cleanly with that checkpoint."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", "2", "--run-dir", str(run), _empty_config(tmp_path),
           *[a for s in [*BASE, f"data.path={micro_dataset}", "train.threads=1", *STEPS, "checkpoint.interval=100",
                         PACED] for a in ("--set", s)]]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), start_new_session=True)
    try:
        deadline = time.time() + 240
        while last_step(run) < 2 and time.time() < deadline and job.poll() is None:
            time.sleep(0.1)
        workers = [p for p in psutil.Process(job.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert len(workers) == 1
        workers[0].send_signal(signal.SIGUSR1)
        out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out[-3000:]
    stopped = json.loads((run / "preempted.json").read_text())
    assert stopped["signal"] == "SIGTERM/SIGUSR1 on another rank"  # rank 0 writes it; rank 1 got the signal
    assert f"stopped on SIGTERM/SIGUSR1 on another rank after step {stopped['step']}" in out and stopped["step"] < 12
    assert [step for step, _ in step_dirs(run / "checkpoints")] == [stopped["step"]]


def test_launcher_arguments_are_checked_before_anything_starts():
    assert Launch(2).torchrun_args(["train"])[:1] == ["--standalone"]
    args = Launch(4, 3, "1:2", "10.0.0.1:29500", "job", 0).torchrun_args(["train", "c.toml"])
    assert args[:2] == ["--nnodes", "1:2"] and "c10d" in args and "10.0.0.1:29500" in args
    assert args[args.index("--rdzv-conf") + 1] == "is_host=true" and args[-3:] == ["hardy", "train", "c.toml"]
    for bad, message in [(Launch(2, nnodes="2"), "needs --rdzv-endpoint"),
                         (Launch(2, nnodes="3:2", rdzv_endpoint="h:1"), "MIN <= MAX"),
                         (Launch(2, nnodes="2", rdzv_endpoint="nohost"), "HOST:PORT"),
                         (Launch(2, rdzv_endpoint="h:1"), "go with --nnodes"), (Launch(0), "--nproc")]:
        with pytest.raises(HardyError, match=message):
            bad.torchrun_args(["train"])
    assert node_rank_of(None, "2", {"SLURM_NODEID": "1"}) == 1 and node_rank_of(0, "2", {"SLURM_NODEID": "1"}) == 0
    assert node_rank_of(None, "2", {}) is None and node_rank_of(None, None, {"SLURM_NODEID": "1"}) is None
    proc = hardy_main("launch", "configs/tiny-cpu.toml", "--nproc", "3", "--nnodes", "1:2",
                     "--rdzv-endpoint", "127.0.0.1:1", "--set", "parallel.tp=2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "tp" in proc.stderr


def fake_slurm(bin_dir, head_ip: str):
    """scontrol/srun/hostname as a two-node allocation would answer; srun prints the launcher it starts."""
    scripts = {
        "scontrol": f'echo "$*" >> {bin_dir}/scontrol.log; echo node-a; echo node-b',
        "srun": ('while [ "${1#-}" != "$1" ]; do case "$1" in -w) shift 2;; *) shift;; esac; done\n'
                 'if [ "$1" = hostname ]; then exec "$@"; fi\necho "LAUNCH $*"'),
        "hostname": f'if [ "$1" = --ip-address ]; then echo "{head_ip}"; else echo "10.1.2.3 172.17.0.1"; fi',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("head_ip,expected", [("10.9.8.7", "10.9.8.7"), ("127.0.1.1", "10.1.2.3")])
def test_slurm_script_finds_the_head_node_and_starts_one_launcher_per_node(tmp_path, head_ip, expected):
    proc = hardy_main("launch", "configs/tiny-cpu.toml", "--slurm", "--nodes", "2", "--gpus-per-node", "4",
                     "--run-dir", str(tmp_path / "run"), "--set", "train.steps=50", "--time", "01:00:00")
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "run" / "sbatch.sh").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --time=01:00:00", 'scontrol show hostnames "$SLURM_JOB_NODELIST"',
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue"):
        assert line in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_slurm(bin_dir, head_ip)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_JOB_ID="4242")
    ran = subprocess.run(["bash", str(tmp_path / "run" / "sbatch.sh")], capture_output=True, text=True, env=env,
                         timeout=60)
    assert ran.returncode == 0, ran.stderr
    launched = [line for line in ran.stdout.splitlines() if line.startswith("LAUNCH")]
    assert len(launched) == 1
    words = launched[0].split()
    assert words[words.index("--rdzv-endpoint") + 1] == f"{expected}:29500"
    assert words[words.index("--nnodes") + 1] == "2" and words[words.index("--nproc") + 1] == "4"
    assert words[words.index("--rdzv-id") + 1] == "4242" and "train.steps=50" in words
    assert str(REPO / "configs" / "tiny-cpu.toml") in words
    assert "requeue" not in (bin_dir / "scontrol.log").read_text()  # the run ended: nothing to requeue
    (tmp_path / "run" / "preempted.json").write_text('{"step": 7}')  # it stopped on the warning signal
    again = subprocess.run(["bash", str(tmp_path / "run" / "sbatch.sh")], capture_output=True, text=True, env=env,
                           timeout=60)
    assert again.returncode == 0 and "requeue 4242" in (bin_dir / "scontrol.log").read_text(), again.stderr


def test_a_live_slurm_script_keeps_the_allocation_when_a_node_fails_and_checks_its_groups_fit_the_nodes():
    live = ["--set", "fault.recovery=live", "--set", "parallel.dp_replicate=4", "--print"]
    proc = hardy_main("launch", "configs/tiny-cpu.toml", "--slurm", "--nodes", "2", "--nproc", "2", *live)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --no-kill" in proc.stdout and "srun --kill-on-bad-exit=0 " in proc.stdout
    restart = hardy_main("launch", "configs/tiny-cpu.toml", "--slurm", "--nodes", "2", "--nproc", "2", "--print")
    assert restart.returncode == 0 and "--no-kill" not in restart.stdout and "kill-on-bad-exit" not in restart.stdout
    # 2 groups of 3 processes cannot sit on nodes of 2
    bad = hardy_main("launch", "configs/tiny-cpu.toml", "--slurm", "--nodes", "3", "--nproc", "2", *live[:2],
                     "--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=3", "--print")
    assert bad.returncode == 2 and "runs on one node: --nproc 2 must be a multiple of 3" in bad.stderr


def test_slurm_script_refuses_what_cannot_work():
    for args, message in [(["--slurm"], "--nodes"), (["--slurm", "--nodes", "2", "--gpus-per-node", "4", "--nproc", "2"],
                                                     "one process per GPU"),
                          (["--slurm", "--nodes", "2", "--nnodes", "2"], "leave out --nnodes")]:
        proc = hardy_main("launch", "configs/tiny-cpu.toml", *args, "--print")
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1
