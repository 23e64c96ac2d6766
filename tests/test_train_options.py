"""Single-process trainer options on the micro preset: precision, activation checkpointing, loss pieces."""
from __future__ import annotations

import logging

import pytest
import torch

from trainutil import in_process, read_records, rel_close, step_losses


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory, micro_dataset):
    run = tmp_path_factory.mktemp("opts") / "fp32"
    in_process(run, micro_dataset)
    return step_losses(run)


@pytest.mark.parametrize("mode", ["full", "every:2", "selective"])
def test_activation_checkpointing_gives_the_same_loss(tmp_path, micro_dataset, fp32_losses, mode):
    in_process(tmp_path / "ac", micro_dataset, f"train.activation_checkpoint={mode}")
    assert rel_close(step_losses(tmp_path / "ac"), fp32_losses, 1e-6)


def test_dropout_trains_and_checkpointing_recomputes_the_same_masks(tmp_path, micro_dataset, fp32_losses):
    in_process(tmp_path / "drop", micro_dataset, "model.dropout=0.2")
    dropped = step_losses(tmp_path / "drop")
    assert not rel_close(dropped, fp32_losses, 1e-3)  # the masks change the losses
    assert dropped[-1] < dropped[0]
    for mode in ("full", "selective"):  # selective recomputes dropout's draw from the restored RNG state
        in_process(tmp_path / mode, micro_dataset, "model.dropout=0.2", f"train.activation_checkpoint={mode}")
        assert rel_close(step_losses(tmp_path / mode), dropped, 1e-6), mode


@pytest.mark.parametrize("dtype,tol", [("bf16", 0.02), ("fp16", 0.01)])
def test_low_precision_tracks_fp32(tmp_path, micro_dataset, fp32_losses, dtype, tol, caplog):
    from hardy.ops.matmul_probe import has_fast_bf16

    with caplog.at_level(logging.WARNING):
        in_process(tmp_path / dtype, micro_dataset, f"precision.dtype={dtype}")
    losses = step_losses(tmp_path / dtype)
    assert abs(losses[-1] - fp32_losses[-1]) <= tol * fp32_losses[-1], (losses[-1], fp32_losses[-1])
    assert losses[-1] < losses[0]
    warned = "without native bf16" in caplog.text
    assert warned == (not has_fast_bf16(torch.device("cpu")))


def test_bf16_detection_reads_cpu_flags(monkeypatch):
    import builtins
    import io

    from hardy.ops import matmul_probe

    real_open = builtins.open
    for flags, expected in (("fpu avx2 fma", False), ("fpu avx2 avx512_bf16 fma", True), ("fpu amx_bf16 x", True)):
        monkeypatch.setattr(builtins, "open", lambda p, *a, **k: io.StringIO(f"flags\t: {flags}\n")
                            if p == "/proc/cpuinfo" else real_open(p, *a, **k))
        assert matmul_probe.has_fast_bf16(torch.device("cpu")) is expected


def test_reduce_dtype_reaches_fsdp2_and_rounds_the_gradients(tmp_path, micro_dataset, fp32_losses):
    """One process through FSDP2 (a one-rank group): with reduce_dtype fp32 the wrapper changes no
    number; with bf16 the gradients are rounded on their way through the reduction, so the losses move
    (a little) — which they would not if the setting never reached FSDP2."""
    for dtype in ("fp32", "bf16"):
        in_process(tmp_path / dtype, micro_dataset, "parallel.wrap=fsdp", f"precision.reduce_dtype={dtype}")
    start = {d: next(r for r in read_records(tmp_path / d) if r["event"] == "start") for d in ("fp32", "bf16")}
    assert start["fp32"]["fsdp"]["reduce_dtype"] == ["float32"] and start["bf16"]["fsdp"]["reduce_dtype"] == ["bfloat16"]
    assert step_losses(tmp_path / "fp32") == fp32_losses
    rounded = step_losses(tmp_path / "bf16")
    assert rounded != fp32_losses and rel_close(rounded, fp32_losses, 1e-4)


def test_grad_clipping_uses_the_global_norm(tmp_path, micro_dataset):
    in_process(tmp_path / "clip", micro_dataset, "optim.grad_clip=0.05", "train.steps=3")
    in_process(tmp_path / "noclip", micro_dataset, "optim.grad_clip=0", "train.steps=3")
    clipped, free = step_losses(tmp_path / "clip"), step_losses(tmp_path / "noclip")
    assert clipped[0] == free[0] and clipped[2] != free[2]


def test_fused_linear_cross_entropy_matches_reference():
    import hardy.model.loss as L

    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    old, L._MAX_CHUNK_ELEMENTS = L._MAX_CHUNK_ELEMENTS, 300  # several chunks
    try:
        ours = L.linear_cross_entropy(h, w, t)
        gh, gw = torch.autograd.grad(ours * 3.0, (h, w))
    finally:
        L._MAX_CHUNK_ELEMENTS = old
    ref = torch.nn.functional.cross_entropy(h @ w.t(), t)
    rh, rw = torch.autograd.grad(ref * 3.0, (h, w))
    assert abs(ours.item() - ref.item()) < 1e-6
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path, micro_dataset):
    # 2^22 x the loss overflows fp16 in backward: torch's GradScaler finds the inf, the trainer skips
    # the step on every rank, and the scale halves until it fits; then training proceeds.
    in_process(tmp_path / "ovf", micro_dataset, "precision.dtype=fp16", "precision.loss_scale=4194304",
               "train.steps=8")
    steps = [r for r in read_records(tmp_path / "ovf") if r["event"] == "step"]
    skipped = [r["skipped"] for r in steps]
    scales = [r["loss_scale"] for r in steps]
    assert skipped[0] and not all(skipped), skipped
    for i in range(len(steps) - 1):  # a skipped step halves the scale; a good one keeps it (growth: 200 steps)
        assert scales[i + 1] == (scales[i] / 2 if skipped[i] else scales[i]), scales
    assert all(r["grad_norm"] is not None for r, bad in zip(steps, skipped) if not bad)  # finite when applied
    assert steps[-1]["loss"] < steps[skipped.index(False)]["loss"]


def test_grad_scaler_resumes_the_earlier_format():
    from hardy.train.precision import load_scaler_state, make_grad_scaler

    scaler = make_grad_scaler(True, torch.device("cpu"), False, 65536.0, 200)
    load_scaler_state(scaler, {"scale": 1024.0, "good_steps": 3}, 200)  # hardy's own scaler, before torch's
    assert scaler.get_scale() == 1024.0 and scaler._get_growth_tracker() == 3
    assert scaler.get_growth_interval() == 200
    load_scaler_state(scaler, {}, 200)  # saved without scaling (bf16/fp32): the configured start stays
    assert scaler.get_scale() == 1024.0


def test_global_grad_norm_matches_torch():
    from hardy.parallel.grads import global_grad_norm

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.nn.utils.clip_grad_norm_(params, float("inf")).item()
    assert abs(global_grad_norm(params) - expected) < 1e-5


def test_torch_compile_matches_eager(tmp_path, micro_dataset):
    in_process(tmp_path / "eager", micro_dataset, "train.steps=3")
    in_process(tmp_path / "compiled", micro_dataset, "train.steps=3", "train.compile=true")
    assert rel_close(step_losses(tmp_path / "compiled"), step_losses(tmp_path / "eager"), 1e-4)
