"""hardy.plan.goodput at its edges: failures at the job's end and at the hardware share's bounds (drawn
from a scripted generator), recoveries that touch the job's start and end or a spare's return, and
simulate's refusals, defaults and 95% interval."""
from __future__ import annotations

import argparse

import pytest

from hardy.errors import HardyError
from hardy.plan import goodput
from hardy.plan.goodput import Fleet, Recovery, failures, live_goodput, restart_goodput, simulate

DAY = 86400.0
# job MTBF = 256 device-hours / 256 GPUs = 1 h; 2 groups
HOURLY = Fleet(gpus=256, group_gpus=128, days=1, device_mtbf_hours=256, hardware_share=0.5)
# 8 groups; a software fault costs its group 5 + 1 s, a hardware one 1006 s, a spare 3 s; checkpoints 1%
FLEET = Fleet(gpus=1024, group_gpus=128, days=1)
REC = Recovery(survivor_stall_s=2, group_restart_s=5, heal_s=1, node_replace_s=1000, spare_join_s=3,
               checkpoint_stall_s=10, live_checkpoint_s=990)


class ScriptedRng:
    """Stands in for random.Random: the gaps between failures and the uniform draws, in order."""

    def __init__(self, gaps, uniforms=()):
        self.gaps, self.uniforms, self.rates = iter(gaps), iter(uniforms), []

    def expovariate(self, rate):
        self.rates.append(rate)
        return next(self.gaps)

    def random(self):
        return next(self.uniforms)


def test_failures_arrive_at_the_job_rate_and_stop_at_its_wall_time():
    rng = ScriptedRng([DAY - 0.5, 0.7, 10.0], [0.9, 0.1])
    # the second failure lands 0.2 s after the day's job ended: not an interruption
    assert failures(HOURLY, rng) == [(DAY - 0.5, False)]
    assert rng.rates == [pytest.approx(1 / 3600)] * 2


def test_a_failure_drawn_exactly_at_the_end_is_after_the_job():
    assert failures(HOURLY, ScriptedRng([DAY, 5.0], [0.0])) == []


@pytest.mark.parametrize("share, uniform, hardware", [
    (0.0, 0.0, False),  # no hardware share: never a hardware fault, even at random()'s lowest value
    (1.0, 0.999, True),
    (0.5, 0.5, False),  # uniform on [0, 1): P(u < share) = share, so u = share itself is software
])
def test_the_hardware_share_is_the_probability_of_a_hardware_fault(share, uniform, hardware):
    fleet = Fleet(gpus=256, group_gpus=128, days=1, device_mtbf_hours=256, hardware_share=share)
    assert failures(fleet, ScriptedRng([100.0, DAY], [uniform])) == [(100.0, hardware)]


def test_a_job_shorter_than_its_first_checkpoint_keeps_all_its_work():
    # half a second without failures, long before the first (Daly) checkpoint: all of it is useful
    half_second = Fleet(gpus=256, group_gpus=128, days=0.5 / DAY)
    assert restart_goodput(half_second, Recovery(), []) == pytest.approx(1.0)


def test_the_last_half_second_after_a_restart_counts():
    rec = Recovery(restart_s=DAY - 0.5)  # a fault at 0 and a restart that ends half a second early
    assert restart_goodput(HOURLY, rec, [(0.0, True)]) == pytest.approx(0.5 / DAY)


def test_a_restart_that_outlasts_the_job_leaves_no_useful_work_even_with_free_checkpoints():
    # checkpoint_stall_s = 0 is accepted by Recovery.check; the Daly interval is then 0 as well
    rec = Recovery(restart_s=DAY, checkpoint_stall_s=0)
    assert restart_goodput(HOURLY, rec, [(0.0, True)]) == 0.0


def test_free_checkpoints_lose_only_the_restarts():
    # no stall: every moment is committed, so a fault costs its restart and nothing before it
    rec = Recovery(restart_s=600.0, checkpoint_stall_s=0)
    assert restart_goodput(HOURLY, rec, []) == pytest.approx(1.0)
    assert restart_goodput(HOURLY, rec, [(1000.0, True), (50000.0, False)]) == pytest.approx(1 - 1200 / DAY)
    # a fault half a second after a restart: that half second counts too
    assert restart_goodput(HOURLY, rec, [(1000.0, True), (1600.5, False)]) == pytest.approx(1 - 1200 / DAY)
    result = simulate(Fleet(gpus=256), rec, ["restart"], trials=2)  # used to divide by zero
    assert 0 < result["strategies"]["restart"]["mean"] <= 1


def _live(lost_group_s: float) -> float:
    return (1 - lost_group_s / (8 * DAY)) * (1 - 10 / 1000)


def test_warm_spares_are_ready_from_the_job_s_start():
    # the spares are started before the job: a fault in its first second gets one (3 s, not 1006 s)
    assert live_goodput(FLEET, REC, [(0.5, True)], spares=1) == pytest.approx(_live(2 * 8 + 3))
    assert live_goodput(FLEET, REC, [(0.0, True)], spares=1) == pytest.approx(_live(2 * 8 + 3))


def test_a_repaired_group_is_a_spare_from_the_moment_it_is_back():
    # the group failed at 100 s is back in the pool at 100 + 1006 s, just as the next fault strikes
    events = [(100.0, True), (1106.0, True)]
    assert live_goodput(FLEET, REC, events, spares=1) == pytest.approx(_live(2 * 2 * 8 + 3 + 3))


def test_downtime_past_the_job_s_end_is_not_lost():
    # a hardware fault 10 s before the end: its group is down for those 10 s, not the 1006 s
    assert live_goodput(FLEET, REC, [(DAY - 10, True)], spares=0) == pytest.approx(_live(2 * 8 + 10))


@pytest.mark.parametrize("fleet, kwargs, message", [
    (HOURLY, {"strategies": ["restart", "hope", "dream"]},
     "unknown strategy 'hope': choose from restart, live, live+spares"),
    (HOURLY, {"trials": 0}, "--trials must be >= 1 (got 0)"),
    (Fleet(gpus=256, days=0), {}, "--days and --device-mtbf-hours must be > 0, --hardware-share within [0, 1]"),
])
def test_simulate_refuses_bad_requests_with_a_message_naming_the_fault(fleet, kwargs, message):
    with pytest.raises(HardyError) as err:
        simulate(fleet, Recovery(), **kwargs)
    assert str(err.value) == message


def test_simulate_s_defaults_reproduce_the_cli_s_default_run():
    from hardy.cli.plan_goodput import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["goodput"])
    fleet = Fleet(16384, days=5)  # ~39 interruptions a trial
    assert simulate(fleet, Recovery()) == simulate(fleet, Recovery(), trials=args.trials, seed=args.seed)


@pytest.mark.parametrize("trials, low, high", [(40, 1.0, 40.0), (41, 2.0, 40.0)])
def test_the_95_interval_ends_are_the_samples_around_the_2_5_and_97_5_percentiles(monkeypatch, trials, low, high):
    """Quantile q sits at position q(n - 1) of the sorted trials; the interval is widened to the samples
    outside it. 40 trials: 0.975 and 38.025 -> the lowest and highest; 41: exactly 1 and 39 -> 2nd of
    each end. The trials' goodputs are scripted 1..n, out of order."""
    scripted = iter([(7 * i) % trials + 1.0 for i in range(trials)])
    monkeypatch.setattr(goodput, "restart_goodput", lambda fleet, rec, events: next(scripted))
    s = simulate(HOURLY, Recovery(), ["restart"], trials=trials)["strategies"]["restart"]
    middle = (trials + 1) / 2
    assert s == {"mean": pytest.approx(middle), "median": middle, "low": low, "high": high}
