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
    from hardy.compress.quant import QuantSpec, rtn
    from hardy.parallel.quantized_tp import slice_quantized

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
