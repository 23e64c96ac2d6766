"""hardy generate --tp N: N torchrun processes (gloo), each holding a slice of every matrix, give the
same greedy tokens as one process."""
from __future__ import annotations

from conftest import run_hardy


def test_tp2_generates_the_same_greedy_tokens_as_tp1(mini_run):
    args = ["generate", "--model", str(mini_run / "run"), "--prompt", "KING:", "--max-new-tokens", "32", "--threads", "2"]
    one = run_hardy(*args)
    two = run_hardy(*args, "--tp", "2", timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and len(one.stdout) > len("KING:") + 10


def test_tp_bad_input_fails_before_starting_workers(mini_run, tmp_path):
    bad = run_hardy("generate", "--model", str(mini_run / "run"), "--prompt", "x", "--tp", "3")
    assert bad.returncode == 2 and "does not divide" in bad.stderr and "Traceback" not in bad.stderr
    out = tmp_path / "q"
    assert run_hardy("compress", "--model", str(mini_run / "run"), "--out", str(out), "--quant", "rtn",
                     "--bits", "8", "--no-progress").returncode == 0
    bad = run_hardy("generate", "--model", str(out), "--prompt", "x", "--tp", "2")
    assert bad.returncode == 2 and "compressed model" in bad.stderr
