"""Checkpoint-interval and goodput formulas against worked examples; the event-log accounting."""
from __future__ import annotations

import json

import pytest

from hardy.fault.goodput import account
from hardy.fault.inject import parse_faults
from hardy.fault.policy import (DEFAULT_DEVICE_MTBF_HOURS, SpikeDetector, daly_interval, expected_goodput,
                                young_interval)
from hardy.errors import HardyError


def test_daly_worked_examples():
    # Daly (2006): M = 24 h, delta = 5 min -> 117 min; M = 6 h -> 57 min.
    assert daly_interval(5, 24 * 60) == pytest.approx(117, abs=0.5)
    assert daly_interval(5, 6 * 60) == pytest.approx(57, abs=0.5)
    assert young_interval(5, 24 * 60) == pytest.approx((2 * 5 * 24 * 60) ** 0.5)
    assert daly_interval(10, 4) == 4  # delta >= 2M: checkpointing cannot help, T = M


def _exact_daly_optimum(delta: float, mtbf: float) -> float:
    """The interval that minimizes Daly's own model of the expected wall time per unit of work,
    (exp((T + delta) / M) - 1) / T (exponential failures, restart cost aside), by ternary search."""
    import math

    cost = lambda t: (math.exp((t + delta) / mtbf) - 1) / t  # noqa: E731
    lo, hi = 1e-9 * mtbf, 5 * mtbf
    for _ in range(200):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        lo, hi = (lo, b) if cost(a) < cost(b) else (a, hi)
    return (lo + hi) / 2


@pytest.mark.parametrize("ratio, tolerance", [(1e-4, 2e-6), (1e-3, 2e-6), (1e-2, 2e-5), (0.1, 5e-4)])
def test_daly_interval_is_the_optimum_of_daly_s_model(ratio, tolerance):
    """The higher-order formula approximates the argmin of Daly's exact model, closer than its terms:
    each of them (the sqrt(x)/3 and x/9 corrections) moves it by more than the tolerance somewhere
    (measured: dropping x/9's sign to minus, 1.3e-2 off at delta/M = 0.1; x/10, 1.0e-3 there)."""
    mtbf = 1000.0
    exact = _exact_daly_optimum(ratio * mtbf, mtbf)
    assert daly_interval(ratio * mtbf, mtbf) == pytest.approx(exact, rel=tolerance)


def test_no_spike_during_warmup_and_the_threshold_itself_is_not_one():
    d = SpikeDetector(window=5, threshold=6.0, warmup=10)
    for loss in (1.0, 2.0, 3.0, 4.0, 5.0):
        d.observe(loss)
    assert not d.is_spike(1000.0)  # 5 of 10 warm-up steps seen, though the window has enough values
    for loss in (1.0, 2.0, 3.0, 4.0, 5.0):
        d.observe(loss)
    # median 3, MAD median(2, 1, 0, 1, 2) = 1: the bound is 3 + 6 * 1 = 9, exclusive
    assert not d.is_spike(9.0) and d.is_spike(9.000001) and d.is_spike(1000.0)


def test_first_order_goodput():
    # T = 60, delta = 1, M = 3600, R = 30: 1 - 1/60 - (30 + 30)/3600
    assert expected_goodput(60, 1, 3600, 30) == pytest.approx(1 - 1 / 60 - 60 / 3600)


def test_default_mtbf_is_the_llama3_rate():
    assert DEFAULT_DEVICE_MTBF_HOURS == pytest.approx(50_700, rel=0.01)
    assert 1 / DEFAULT_DEVICE_MTBF_HOURS == pytest.approx(1.97e-5, rel=0.01)


def test_spike_detector_median_mad():
    d = SpikeDetector(window=10, threshold=6.0, warmup=5)
    for x in [2.0, 2.1, 1.9, 2.05, 1.95, 2.0]:
        assert not d.is_spike(x)
        d.observe(x)
    assert not d.is_spike(2.2)
    assert d.is_spike(3.0)  # median 2.0, MAD 0.05: threshold 2.3


def test_fault_spec_parsing():
    assert [(f.kind, f.step, f.rank) for f in parse_faults("kill@37,nan@50@rank1")] == [("kill", 37, 0), ("nan", 50, 1)]
    with pytest.raises(HardyError):
        parse_faults("explode@3")


def test_goodput_accounting_from_events(tmp_path):
    ev = [
        {"event": "start", "time": 0.0, "step": 0},
        *[{"event": "step", "time": float(i), "step": i, "step_time_s": 1.0, "skipped": False} for i in (1, 2, 3)],
        {"event": "checkpoint", "time": 3.5, "step": 2, "stall_s": 0.5},
        # crash after step 3; restart resumes from step 2 and redoes step 3
        {"event": "start", "time": 10.0, "step": 2},
        {"event": "step", "time": 12.0, "step": 3, "step_time_s": 1.0, "skipped": False},
        {"event": "step", "time": 13.0, "step": 4, "step_time_s": 1.0, "skipped": True},
        {"event": "end", "time": 13.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"schema": 1, **e}) for e in ev) + "\n")
    g = account(tmp_path)
    assert g["wall_s"] == 13.0 and g["useful_s"] == 3.0 and g["restarts"] == 1
    assert g["losses_s"]["recomputed"] == 1.0  # the first step 3
    assert g["losses_s"]["skipped"] == 1.0
    assert g["losses_s"]["checkpoints"] == 0.5
    assert g["losses_s"]["restarts"] == pytest.approx(12.0 - 1.0 - 3.5)  # last event 3.5 -> next step start 11
    assert g["goodput"] == pytest.approx(3 / 13)


def test_goodput_counts_async_checkpoint_waits_and_completion(tmp_path):
    ev = [
        {"event": "start", "time": 0.0, "step": 0},
        {"event": "step", "time": 1.0, "step": 1, "step_time_s": 1.0, "skipped": False},
        {"event": "checkpoint", "time": 1.1, "step": 1, "stall_s": 0.1},  # async hand-off
        # the next step waited 0.2 s for the staging copy; the save completed after step 3
        {"event": "step", "time": 2.1, "step": 2, "step_time_s": 1.0, "skipped": False, "ckpt_wait_s": 0.2},
        {"event": "step", "time": 3.1, "step": 3, "step_time_s": 1.0, "skipped": False, "ckpt_wait_s": 0.0},
        {"event": "checkpoint_complete", "time": 3.4, "step": 1, "stall_s": 0.3},
        {"event": "end", "time": 3.4},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({"schema": 1, **e}) for e in ev) + "\n")
    g = account(tmp_path)
    assert g["useful_s"] == pytest.approx(2.8)
    assert g["losses_s"]["checkpoints"] == pytest.approx(0.6)
    assert g["goodput"] == pytest.approx(2.8 / 3.4)


def test_goodput_with_failures_only_during_steps():
    from hardy.fault.policy import expected_goodput_step_failures

    # T = 4 s, delta = 0.2 s, R = 5 s, M = 50 s: 1 / (1 + 0.05 + 7/48)
    assert expected_goodput_step_failures(4.0, 0.2, 50.0, 5.0) == pytest.approx(1 / (1 + 0.05 + 7 / 48))
    # agrees with the first-order formula when failures are rare
    assert expected_goodput_step_failures(60, 1, 1e6, 60) == pytest.approx(expected_goodput(60, 1, 1e6, 60), abs=1e-3)
    assert expected_goodput_step_failures(10, 1, 4, 1) == 0.0


def test_injection_acts_through_the_step_hooks_at_its_step_only_and_once(tmp_path):
    """The trainer calls StepHooks; the injector, one of its hook objects, turns the configured step's
    loss into NaN (and only that step's, and only the first time it is reached: a resumed run replays
    it cleanly), and a hook object without some of the methods is simply not called there."""
    import torch

    from hardy.fault.inject import FaultInjector
    from hardy.train.hooks import StepHooks

    calls = []

    class Recorder:
        def before_step(self, step):
            calls.append(("before", step))

        def loss(self, step, loss):
            calls.append(("loss", step))
            return loss + 1

    hooks = StepHooks([FaultInjector("nan@3,spike@4", tmp_path, rank=0), Recorder()])
    seen = {}
    for step in (2, 3, 4, 3):
        hooks.before_step(step)
        seen.setdefault(step, []).append(hooks.loss(step, torch.tensor(1.0)).item())
        hooks.after_step(step)  # the recorder has none: skipped
        hooks.checkpoint_written(step)
    assert seen[2] == [2.0] and seen[4] == [21.0]  # spike: 20x, then the recorder's + 1
    assert torch.isnan(torch.tensor(seen[3][0])) and seen[3][1] == 2.0  # the replayed step 3 is clean
    assert calls == [("before", 2), ("loss", 2), ("before", 3), ("loss", 3), ("before", 4), ("loss", 4),
                     ("before", 3), ("loss", 3)]
    assert json.loads((tmp_path / "faults_fired.json").read_text()) == ["nan@3@rank0", "spike@4@rank0"]
