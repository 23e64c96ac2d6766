"""hardy.fault.policy at its edges: the Daly and step-failure goodput bounds, the spike detector's
documented defaults (README: "loss > median + 6 x MAD of the last 50 steps, after 50 steps"), its
smallest window, its MAD floor, and its state round trip (saved in checkpoints, hardy.train)."""
from __future__ import annotations

import json

import pytest

from hardy.fault.policy import SpikeDetector, daly_interval, expected_goodput_step_failures

STEADY = [1.9, 2.1] * 25  # 50 losses: median 2.0, every deviation 0.1 -> MAD 0.1


def test_daly_interval_at_exactly_twice_the_mtbf_is_the_mtbf():
    # the docstring's bound is inclusive: delta >= 2M -> T = M (the series would give 8M/9 there)
    assert daly_interval(20.0, 10.0) == 10.0
    assert daly_interval(20.5, 10.0) == 10.0


def test_step_failure_goodput_with_an_interval_as_long_as_the_mtbf():
    # T = M = 10, delta = 1, R = 0: F = (U + 5F)/10 -> F = U/5; wall = 1.1U + F*5 = 2.1U
    assert expected_goodput_step_failures(10.0, 1.0, 10.0, 0.0) == pytest.approx(1 / 2.1)


def test_step_failure_goodput_is_zero_once_half_an_interval_reaches_the_mtbf():
    # T/2 = M: F = (U + F*M)/M leaves U = 0, no useful work (and no division by M - T/2 = 0)
    assert expected_goodput_step_failures(20.0, 1.0, 10.0, 1.0) == 0.0


def _fed(detector: SpikeDetector, losses) -> SpikeDetector:
    for loss in losses:
        detector.observe(loss)
    return detector


def test_default_detector_decides_from_the_fiftieth_step_at_six_mads():
    d = _fed(SpikeDetector(), STEADY[:49])
    assert not d.is_spike(1000.0)  # 49 steps seen: still warming up
    d.observe(STEADY[49])
    # bound 2.0 + 6 * 0.1 = 2.6 (7 MADs would put it at 2.7)
    assert d.is_spike(2.65) and not d.is_spike(2.55)


def test_default_window_forgets_losses_older_than_fifty_steps():
    # early training at loss 10 must not widen the band once 50 newer steps are in: median 2.0, MAD 0.1
    # over the last 50 flags 3.0 (a window holding even one of the old 10s has MAD 0.2: bound 3.3)
    d = _fed(SpikeDetector(), [10.0] * 30 + STEADY)
    assert d.is_spike(3.0)
    assert d.state_dict()["history"] == STEADY


def test_the_smallest_allowed_window_of_three_gives_verdicts():
    # fault.spike_window >= 3 is accepted (train config): three losses are enough for median and MAD
    d = _fed(SpikeDetector(window=3, threshold=6.0, warmup=0), [1.0, 2.0])
    assert not d.is_spike(1000.0)  # two losses: no verdict
    d.observe(3.0)
    assert d.is_spike(8.5) and not d.is_spike(7.5)  # median 2, MAD 1: bound 8


def test_warmup_counts_the_steps_observed_from_zero():
    d = _fed(SpikeDetector(window=10, threshold=6.0, warmup=5), [1.0, 2.0, 3.0, 2.0])
    assert not d.is_spike(1000.0)  # 4 of 5 warm-up steps
    d.observe(2.0)
    assert d.is_spike(1000.0)


def test_a_flat_loss_tolerates_relative_noise_at_its_own_scale():
    """A constant history has MAD 0; the band is then 6 x 1e-6 of the loss itself, so a part per million
    is noise at loss 10 and a 5% rise is a spike at loss 0.01, whatever the loss's units."""
    high = _fed(SpikeDetector(window=10, threshold=6.0, warmup=0), [10.0] * 10)
    assert not high.is_spike(10.00001) and high.is_spike(10.001)
    low = _fed(SpikeDetector(window=10, threshold=6.0, warmup=0), [0.01] * 10)
    assert low.is_spike(0.0105) and not low.is_spike(0.01 + 1e-9)


def test_state_dict_holds_the_window_and_the_steps_seen_as_plain_json():
    d = _fed(SpikeDetector(window=3, threshold=6.0, warmup=0), [5.0, 1.0, 2.0, 3.0])
    state = json.loads(json.dumps(d.state_dict()))  # it travels in checkpoints and the live-recovery state
    assert state == {"history": [1.0, 2.0, 3.0], "seen": 4}


def test_a_restored_detector_resumes_the_warmup_where_it_stopped():
    saved = _fed(SpikeDetector(window=5, threshold=6.0, warmup=6), [1.0, 2.0, 3.0, 4.0]).state_dict()
    d = SpikeDetector(window=5, threshold=6.0, warmup=6)
    d.load_state_dict(saved)
    assert d.seen == 4 and not d.is_spike(1000.0)  # 4 of 6 warm-up steps, as before the save
    d.observe(5.0)
    d.observe(3.0)
    # window [2, 3, 4, 5, 3]: median 3, MAD 1 -> bound 9
    assert d.is_spike(9.5) and not d.is_spike(8.5)


def test_a_restored_detector_judges_as_the_saved_one_and_keeps_its_window_bounded():
    before = _fed(SpikeDetector(window=5, threshold=6.0, warmup=0), [50.0] * 5)
    after = SpikeDetector(window=5, threshold=6.0, warmup=0)
    after.load_state_dict(before.state_dict())
    assert after.is_spike(50.1) and not after.is_spike(50.0)  # the flat 50s' band: 50 + 3e-4
    # five newer losses push every saved one out: median 3, MAD 1 -> bound 9, so 20 is a spike
    _fed(after, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert after.is_spike(20.0)
    assert after.state_dict() == {"history": [1.0, 2.0, 3.0, 4.0, 5.0], "seen": 10}
