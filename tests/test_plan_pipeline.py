"""Pipeline schedules in the training planner: ZB-H1 (zero bubble at 1F1B's memory) beside 1F1B, on
hand-worked cases."""
from __future__ import annotations

import json

import pytest

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.plan.hardware import get_hardware
from hardy.plan.public_runs import arch_for
from hardy.plan.timing import layer_gemm_flops, StepSetup, zero_bubble_h1
from hardy.plan.train import TrainJob, plan_train


def test_zb_h1_fills_the_bubble_with_deferred_weight_gradients():
    """(p − 1)(T_F + T_B − T_W): a micro-batch of 1 s whose weight gradients take 0.3 s leaves 0.4 s per stage
    boundary instead of 1F1B's 1 s; with weight gradients half the micro-batch or more, no bubble."""
    assert zero_bubble_h1(8, 1.0, 0.3) == pytest.approx(7 * 0.4)
    assert zero_bubble_h1(8, 1.0, 0.5) == 0.0 and zero_bubble_h1(8, 1.0, 0.6) == 0.0
    assert zero_bubble_h1(1, 1.0, 0.1) == 0.0


def plan(schedule: str):
    hw = get_hardware("h100-sxm")
    job = TrainJob(arch=arch_for("llama3-70b", 4096), hw=hw, devices=64, seq=4096, tp=8, pp=8,
                   sequence_parallel=True, zero=1, micro_batch=1, global_batch_tokens=16 * 4096, schedule=schedule)
    return job, plan_train(job)


def test_a_zb_h1_plan_differs_from_1f1b_by_the_weight_gradients_it_defers_and_keeps_its_memory():
    job, one = plan("1f1b")
    _, zero = plan("zb-h1")
    assert one.micro_batches == zero.micro_batches == 16
    microbatch = one.step.bubble_s / 7  # 1F1B: (p − 1) micro-batch times
    # the weight-gradient GEMMs of a micro-batch on the last stage (10 of the 80 layers, and the LM head):
    # one projection-sized GEMM per linear, at the GEMM rate
    s = StepSetup(seq=4096, micro_batch=1, micro_batches=16, tp=8, pp=8, sequence_parallel=True)
    fwd, core = layer_gemm_flops(job.arch, s)
    rate = job.hw.gemm_rate("bf16", job.arch.dim)
    weight_grad = 10 * (fwd - core) / rate + 2 * 4096 * 128256 * 8192 / 8 / rate
    assert zero.step.bubble_s == pytest.approx(7 * (microbatch - 2 * weight_grad))
    assert 0 < zero.step.bubble_s < one.step.bubble_s
    assert zero.step.total_s == pytest.approx(one.step.total_s - one.step.bubble_s + zero.step.bubble_s)
    assert zero.memory == one.memory  # p micro-batches in flight, as 1F1B


def test_schedules_on_the_command_line():
    base = ["plan", "train", "--model", "llama3.1-70b", "--hardware", "h100-sxm", "--devices", "64", "--tp", "8",
            "--pp", "8", "--sp", "--zero", "1"]
    one, zero = hardy_main(*base, "--json"), hardy_main(*base, "--schedule", "zb-h1", "--json")
    assert one.returncode == zero.returncode == 0, one.stderr + zero.stderr
    one, zero = json.loads(one.stdout), json.loads(zero.stdout)
    assert (one["parallel"]["schedule"], zero["parallel"]["schedule"]) == ("1f1b", "zb-h1")
    assert zero["step_time_s"]["bubble_s"] < one["step_time_s"]["bubble_s"]
    text = hardy_main(*base, "--schedule", "zb-h1")
    assert text.returncode == 0 and "ZB-H1 schedule" in text.stdout
    bad = hardy_main(*base, "--schedule", "zbv")
    assert bad.returncode == 2 and "invalid choice: 'zbv'" in bad.stderr
    with pytest.raises(HardyError, match="schedule must be 1f1b, interleaved or zb-h1"):
        plan("gpipe")
