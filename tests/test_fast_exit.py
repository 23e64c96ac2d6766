"""Processes that end without the interpreter's teardown (launchers, torchrun agents, launched workers)
still deliver everything they wrote and the exit code they meant."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered, as by default
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=env)


def test_exit_now_flushes_buffered_output_and_keeps_the_code():
    proc = _python(
        "import sys\n"
        "from hardy.fast_exit import exit_now\n"
        "sys.stdout.write('x' * 1000)\n"  # to a pipe: held in the buffer, which a bare os._exit drops
        "exit_now(3)\n")
    assert proc.returncode == 3
    assert proc.stdout == "x" * 1000


def test_the_live_groups_agent_is_torchrun_with_its_exit_codes(tmp_path):
    usage = subprocess.run([sys.executable, "-m", "hardy.fault.agent", "--help"], capture_output=True, text=True,
                           cwd=REPO, timeout=120)
    assert usage.returncode == 0 and "--nproc-per-node" in usage.stdout
    # a worker that exits 2 (an unknown hardy command): torchrun's ChildFailedError, reported, exit 1
    failed = subprocess.run([sys.executable, "-m", "hardy.fault.agent", "--standalone", "--nproc-per-node", "1",
                             "--max-restarts", "0", "--module", "hardy", "no-such-command"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert failed.returncode == 1
    assert "ChildFailedError" in failed.stderr and "no-such-command" in failed.stderr
