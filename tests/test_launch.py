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
from hardy.errors import HardyError
from hardy.ops.launch import Launch, node_rank_of
from trainutil import BASE, assert_bitwise_equal, launch

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
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    out = (tmp_path / "agent0.log").read_text() + (tmp_path / "agent2.log").read_text()
    assert "resumed from step_0000000" in out
    assert_bitwise_equal(run / "checkpoints" / "step_00000012", baseline / "checkpoints" / "step_00000012")


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
        "scontrol": 'echo node-a; echo node-b',
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
                 "#SBATCH --time=01:00:00", 'scontrol show hostnames "$SLURM_JOB_NODELIST"'):
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


def test_slurm_script_refuses_what_cannot_work():
    for args, message in [(["--slurm"], "--nodes"), (["--slurm", "--nodes", "2", "--gpus-per-node", "4", "--nproc", "2"],
                                                     "one process per GPU"),
                          (["--slurm", "--nodes", "2", "--nnodes", "2"], "leave out --nnodes")]:
        proc = hardy_main("launch", "configs/tiny-cpu.toml", *args, "--print")
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1
