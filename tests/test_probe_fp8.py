"""The probe's fp8 GEMM (`hardy probe`: torchao's tensorwise recipe through torch._scaled_mm) and how a
profile's measurement reaches the planner: only a fast (not emulated) fp8 matmul can be planned."""
from __future__ import annotations

import copy

import pytest
import torch

from hardy.errors import HardyError
from hardy.ops import probe
from hardy.plan.hardware import hardware_from_profile
from hardy.plan.public_runs import arch_for
from hardy.plan.train import TrainJob, plan_train
from test_hardware import _profile


def test_the_timed_fp8_multiply_is_the_scaled_gemm_of_the_rounded_operands():
    if probe.fp8_matmul_unsupported(torch.device("cpu")) is not None:
        pytest.skip("this torch build has no CPU float8 matmul")
    torch.manual_seed(0)
    out = probe._square_multiply(probe.FP8, torch.device("cpu"), 32)()
    torch.manual_seed(0)  # the same operands, drawn as the probe draws them, rounded to e4m3
    a, b = (torch.randn(32, 32).to(probe.FP8).float() for _ in range(2))
    assert out.dtype == torch.bfloat16 and out.shape == (32, 32)
    torch.testing.assert_close(out, (a @ b.t()).bfloat16(), rtol=1e-2, atol=1e-2)  # B is passed column-major


def test_devices_without_fp8_say_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability 8.9" in probe.fp8_matmul_unsupported(torch.device("cuda"))
    monkeypatch.setattr(probe, "FP8", None)
    reason = probe.fp8_matmul_unsupported(torch.device("cpu"))
    assert reason == f"torch {torch.__version__} has no float8 matmul"
    skipped = probe.measure_fp8_matmul(torch.device("cpu"), quick=True)
    assert skipped == {"skipped": reason, "recipe": probe.FP8_RECIPE}


def test_a_measured_fp8_matmul_times_every_size(monkeypatch):
    if probe.fp8_matmul_unsupported(torch.device("cpu")) is not None:
        pytest.skip("this torch build has no CPU float8 matmul")
    monkeypatch.setattr(probe, "_matmul_sizes", lambda device, quick: ([16, 32], 0.0, 10.0))
    fp8 = probe.measure_fp8_matmul(torch.device("cpu"), quick=True)
    assert [r["size"] for r in fp8["sizes"]] == [16, 32] and fp8["recipe"] == probe.FP8_RECIPE
    for r in fp8["sizes"]:
        assert r["flops"] == pytest.approx(2 * r["size"] ** 3 / r["seconds"]) and r["multiplies"] >= 2
    assert fp8["best_flops"] == max(r["flops"] for r in fp8["sizes"])


def profile_with_fp8(fast: bool) -> dict:
    p = copy.deepcopy(_profile())
    p["gpu"] = {"name": "Test GPU", "count": 8, "memory_bytes": 80e9}
    p["matmul"].update(fast_bf16=True, fp8={"best_flops": 1.4e15, "sizes": [], "recipe": probe.FP8_RECIPE},
                       fast_fp8=fast)
    p["matmul"]["dtypes"]["bf16"]["best_flops"] = 8e14
    return p


def fp8_job(hw):
    return TrainJob(arch=arch_for("llama3-8b", 4096), hw=hw, devices=8, seq=4096, global_batch_tokens=8 * 4096,
                    zero=3, fp8="tensorwise")


def test_a_fast_fp8_matmul_is_the_profiles_fp8_peak_and_plans():
    hw = hardware_from_profile(profile_with_fp8(fast=True))
    assert hw.peak("fp8") == 1.4e15 and hw.gemm_rate("fp8") == pytest.approx(1.4e15 * hw.flops_efficiency)
    fp8, bf16 = plan_train(fp8_job(hw)), plan_train(TrainJob(**{**fp8_job(hw).__dict__, "fp8": "none"}))
    assert fp8.step.compute_s < bf16.step.compute_s


def test_an_emulated_or_missing_fp8_matmul_is_not_planned():
    unmeasured = profile_with_fp8(fast=True)
    del unmeasured["matmul"]["fp8"], unmeasured["matmul"]["fast_fp8"]  # a profile from before the fp8 probe
    for p in (profile_with_fp8(fast=False), unmeasured):
        hw = hardware_from_profile(p)
        assert "fp8" not in hw.peak_flops
        with pytest.raises(HardyError, match="has no fp8 arithmetic"):
            plan_train(fp8_job(hw))
    broken = profile_with_fp8(fast=True)
    del broken["matmul"]["fp8"]["best_flops"]
    with pytest.raises(HardyError, match="'matmul.fp8.best_flops'"):
        hardware_from_profile(broken, where="probe profile x.json")
