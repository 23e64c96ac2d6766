"""hardy generate --tp N: N torchrun processes (gloo), each holding a slice of every matrix, give the
same greedy tokens as one process."""
from __future__ import annotations

from conftest import hardy_main, run_hardy


def test_tp2_generates_the_same_greedy_tokens_as_tp1(mini_run):
    args = ["generate", "--model", str(mini_run / "run"), "--prompt", "KING:", "--max-new-tokens", "32", "--threads", "2"]
    one = hardy_main(*args)
    two = run_hardy(*args, "--tp", "2", timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and len(one.stdout) > len("KING:") + 10


def test_tp2_quantized_model_generates_the_same_greedy_tokens(mini_compressed):
    """Quantized layers are sharded by slicing their codes and scales (whole groups), and each slice
    runs through the fused kernels: the same greedy tokens as one process."""
    out = mini_compressed("--bits", "4", "--group-size", "32", "--quantize-embeddings")
    args = ["generate", "--model", str(out), "--prompt", "KING:", "--max-new-tokens", "32", "--threads", "2"]
    one = hardy_main(*args)
    two = run_hardy(*args, "--tp", "2", timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and len(one.stdout) > len("KING:") + 10


def test_slices_of_quantized_layers_sum_to_the_whole_layer():
    import torch

    from hardy.compress.qlinear import QuantLinear
    from hardy.formats.quantized import QuantSpec, rtn
    from hardy.compress.tensor_parallel import slice_quantized

    torch.manual_seed(0)
    w, x = torch.randn(96, 256), torch.randn(3, 256)
    for spec in (QuantSpec(bits=4, group_size=32, symmetric=False), QuantSpec(bits=8, group_size=0, symmetric=True),
                 QuantSpec(bits=4, group_size=512, symmetric=False)):  # one group wider than the row
        qt = rtn(w, spec)
        whole = QuantLinear(qt)(x)
        rows = torch.cat([QuantLinear(slice_quantized(qt, "colwise", r, 2, "w"))(x) for r in range(2)], dim=-1)
        cols = sum(QuantLinear(slice_quantized(qt, "rowwise", r, 4, "w"))(x[:, r * 64:(r + 1) * 64]) for r in range(4))
        assert torch.allclose(rows, whole, atol=1e-5) and torch.allclose(cols, whole, atol=1e-4), spec


def test_tp_bad_input_fails_before_starting_workers(mini_run, mini_compressed):
    bad = run_hardy("generate", "--model", str(mini_run / "run"), "--prompt", "x", "--tp", "3")
    assert bad.returncode == 2 and "does not divide" in bad.stderr and "Traceback" not in bad.stderr
    out = mini_compressed("--bits", "4", "--group-size", "128")
    bad = hardy_main("generate", "--model", str(out), "--prompt", "x", "--tp", "2")  # w2: 384 columns = 3 groups
    assert bad.returncode == 2 and "along whole groups" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def _fake_numa(root, cpulists):
    for i, cpus in enumerate(cpulists):
        (root / f"node{i}").mkdir(parents=True)
        (root / f"node{i}" / "cpulist").write_text(cpus + "\n")
    (root / "possible").write_text("0-%d\n" % (len(cpulists) - 1))  # sysfs has such files beside the nodes


def test_numa_topology_and_binding(tmp_path, monkeypatch):
    """`--numa auto`: the kernel's CPU lists are read per node (memory-only nodes left out), ranks are
    spread over the nodes in blocks and pinned to their node's CPUs that the process may use; one
    node, or a node with none of the allowed CPUs, leaves the process unpinned."""
    import os

    from hardy import devices

    assert devices.parse_cpulist("0-3,8-11") == [0, 1, 2, 3, 8, 9, 10, 11]
    assert devices.parse_cpulist("5\n") == [5] and devices.parse_cpulist("\n") == []
    two = tmp_path / "two"
    _fake_numa(two, ["0-3,8-11", "4-7,12-15", ""])  # node2: memory only (CXL, HBM)
    assert devices.numa_cpus(str(two)) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert devices.numa_cpus(str(tmp_path / "absent")) == []

    pinned = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(sorted(cpus)))
    nodes = [devices.bind_to_numa_node(rank, 4, str(two)) for rank in range(4)]
    assert [n for n, _ in nodes] == [0, 0, 1, 1]
    assert pinned == [[0, 1, 2, 3, 8, 9, 10, 11]] * 2 + [[4, 5, 6, 7, 12, 13, 14, 15]] * 2
    assert devices.bind_to_numa_node(1, 2, str(two)) == (1, [4, 5, 6, 7, 12, 13, 14, 15])

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # a cgroup allows only node 0's CPUs
    assert devices.bind_to_numa_node(1, 2, str(two)) is None
    one = tmp_path / "one"
    _fake_numa(one, ["0-15"])
    pinned.clear()
    assert devices.bind_to_numa_node(0, 2, str(one)) is None and pinned == []


def test_numa_binding_takes_effect_in_a_process(tmp_path):
    """The real system call: a process bound to a (fake) node runs on that node's CPUs only."""
    import os
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        allowed = allowed * 2  # one CPU: both fake nodes hold it
    root = tmp_path / "nodes"
    _fake_numa(root, [str(allowed[0]), str(allowed[1])])
    code = ("import os; from hardy.devices import bind_to_numa_node; "
            f"print(bind_to_numa_node(1, 2, {str(root)!r}), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"(1, [{allowed[1]}]) [{allowed[1]}]"
