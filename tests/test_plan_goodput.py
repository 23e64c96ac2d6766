"""hardy plan goodput: the failure simulator against hand-worked histories and the closed form, and its CLI."""
from __future__ import annotations

import json

import pytest

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.fault.policy import daly_interval, expected_goodput
from hardy.plan.goodput import Fleet, Recovery, live_goodput, restart_goodput, simulate

DAY = 86400.0


def test_restart_loses_the_work_since_the_last_checkpoint_and_the_restart():
    fleet = Fleet(gpus=256, group_gpus=128, days=1, device_mtbf_hours=1e9)  # MTBF only sets the interval
    rec = Recovery(restart_s=600, checkpoint_stall_s=60)
    interval = daly_interval(60, fleet.job_mtbf_s)
    assert restart_goodput(fleet, rec, []) == pytest.approx(
        (DAY // (interval + 60) * interval + min(DAY % (interval + 60), interval)) / DAY)
    small = Fleet(gpus=256, group_gpus=128, days=1, device_mtbf_hours=256 * 2)  # job MTBF 2 h -> T ~ 15 min
    interval = daly_interval(60, small.job_mtbf_s)
    fail = 3 * (interval + 60) + 100  # 100 s into the fourth cycle: those 100 s are lost
    rest = DAY - fail - 600
    expected = 3 * interval + rest // (interval + 60) * interval + min(rest % (interval + 60), interval)
    assert restart_goodput(small, rec, [(fail, True)]) == pytest.approx(expected / DAY)
    # a second fault during the restart starts the restart again
    twice = restart_goodput(small, rec, [(fail, True), (fail + 300, False)])
    rest = DAY - fail - 300 - 600
    assert twice == pytest.approx((3 * interval + rest // (interval + 60) * interval
                                   + min(rest % (interval + 60), interval)) / DAY)


def test_restart_simulation_agrees_with_the_first_order_closed_form():
    fleet = Fleet(gpus=16384, days=200)
    rec = Recovery()
    simulated = simulate(fleet, rec, ["restart"], trials=10)["strategies"]["restart"]["mean"]
    mtbf = fleet.job_mtbf_s
    closed = expected_goodput(daly_interval(rec.checkpoint_stall_s, mtbf), rec.checkpoint_stall_s, mtbf, rec.restart_s)
    assert simulated == pytest.approx(closed, abs=0.01)


def test_live_recovery_costs_a_stall_for_all_and_the_dead_groups_downtime():
    fleet = Fleet(gpus=1024, group_gpus=128, days=1)  # 8 groups
    rec = Recovery(survivor_stall_s=2, group_restart_s=5, heal_s=1, node_replace_s=1000, spare_join_s=3,
                   checkpoint_stall_s=10, live_checkpoint_s=990)
    ckpt = 1 - 10 / 1000

    def expected(lost_group_s):
        return (1 - lost_group_s / (8 * DAY)) * ckpt

    assert live_goodput(fleet, rec, [], spares=0) == pytest.approx(ckpt)
    assert live_goodput(fleet, rec, [(100.0, False)], spares=0) == pytest.approx(expected(2 * 8 + 6))
    assert live_goodput(fleet, rec, [(100.0, True)], spares=0) == pytest.approx(expected(2 * 8 + 1006))
    assert live_goodput(fleet, rec, [(100.0, True)], spares=1) == pytest.approx(expected(2 * 8 + 3))
    # one spare: the second fault, before the first group is back in the pool, waits for its own node
    two = [(100.0, True), (200.0, True)]
    assert live_goodput(fleet, rec, two, spares=1) == pytest.approx(expected(2 * 2 * 8 + 3 + 1006))
    later = [(100.0, True), (2000.0, True)]  # by then the repaired group is the spare
    assert live_goodput(fleet, rec, later, spares=1) == pytest.approx(expected(2 * 2 * 8 + 3 + 3))


def test_at_llama3_scale_restart_is_calibrated_and_live_with_spares_meets_the_goals():
    """Issue 39's goals with the documented defaults: restart ~ Llama 3's > 90% at 16K (the calibration of
    restart_s), live + spares >= 99% there and >= 97% at 131K GPUs."""
    small = simulate(Fleet(16384), Recovery(), trials=10)["strategies"]
    large = simulate(Fleet(131072), Recovery(), trials=5)["strategies"]
    assert 0.88 <= small["restart"]["median"] <= 0.92
    assert small["live+spares"]["low"] >= 0.99 and large["live+spares"]["low"] >= 0.97
    assert large["restart"]["high"] < 0.8 < large["live"]["low"]


def test_goodput_cli_prints_the_strategies_side_by_side_and_plots(tmp_path):
    proc = hardy_main("plan", "goodput", "--gpus", "16384", "--strategy", "restart,live", "--trials", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [f["gpus"] for f in out["fleets"]] == [16384]
    assert set(out["fleets"][0]["strategies"]) == {"restart", "live"}
    plot = tmp_path / "goodput.png"
    proc = hardy_main("plan", "goodput", "--trials", "2", "--spares", "1", "--plot", str(plot))
    assert proc.returncode == 0 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "| 131,072 | 1024 |" in proc.stdout and "live+spares" in proc.stdout
    for args, message in [(["--strategy", "hope"], "choose from"), (["--gpus", "100"], "multiple of --group-gpus"),
                          (["--gpus", "128"], "at least two"), (["--heal-s", "-1"], "heal_s"),
                          (["--plot", str(tmp_path / "x.jpg")], ".png")]:
        proc = hardy_main("plan", "goodput", "--trials", "1", *args)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, (args, proc.stderr)


def test_bad_fleets_are_refused():
    with pytest.raises(HardyError, match="hardware-share"):
        simulate(Fleet(256, hardware_share=1.5), Recovery())


def test_a_seed_reproduces_the_simulation_in_any_process_and_another_seed_draws_other_histories():
    import json
    import os
    import subprocess
    import sys

    script = ("import json; from hardy.plan.goodput import Fleet, Recovery, simulate;"
              "print(json.dumps(simulate(Fleet(16384), Recovery(), trials=4, seed=7)))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    elsewhere = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                          check=True, timeout=120).stdout)
    here = simulate(Fleet(16384), Recovery(), trials=4, seed=7)
    assert json.loads(json.dumps(here)) == elsewhere
    other = simulate(Fleet(16384), Recovery(), trials=4, seed=8)
    assert other["strategies"]["restart"]["mean"] != here["strategies"]["restart"]["mean"]


@pytest.mark.parametrize("fleet, message", [
    (Fleet(gpus=0, group_gpus=1), "--gpus 0 must be a positive multiple of --group-gpus 1"),
    (Fleet(gpus=8, group_gpus=0), "--gpus 8 must be a positive multiple of --group-gpus 0"),
    (Fleet(gpus=8, group_gpus=3), "--gpus 8 must be a positive multiple of --group-gpus 3"),
    (Fleet(gpus=8, group_gpus=8), "8 GPUs in groups of 8 is one replica group: live recovery needs at least two"),
    (Fleet(gpus=1, group_gpus=1), "1 GPUs in groups of 1 is one replica group"),  # one GPU is a positive multiple
    (Fleet(gpus=2, group_gpus=1, days=0), "--days and --device-mtbf-hours must be > 0, --hardware-share within [0, 1]"),
    (Fleet(gpus=2, group_gpus=1, device_mtbf_hours=0), "--days and --device-mtbf-hours must be > 0, --hardware-share within [0, 1]"),
    (Fleet(gpus=2, group_gpus=1, hardware_share=-0.01), "--days and --device-mtbf-hours must be > 0, --hardware-share within [0, 1]"),
    (Fleet(gpus=2, group_gpus=1, hardware_share=1.01), "--days and --device-mtbf-hours must be > 0, --hardware-share within [0, 1]"),
])
def test_a_fleet_outside_its_bounds_is_refused_with_the_bound_named(fleet, message):
    with pytest.raises(HardyError) as err:
        fleet.check()
    assert str(err.value).startswith(message)


def test_fleets_and_recoveries_at_their_bounds_are_accepted():
    """The smallest of each: two one-GPU groups, half a day, a one-hour MTBF, no or all hardware failures,
    zero-second recoveries and a checkpoint interval just above zero."""
    for share in (0.0, 1.0):
        Fleet(gpus=2, group_gpus=1, days=0.5, device_mtbf_hours=0.5, hardware_share=share).check()
    Recovery(restart_s=0, checkpoint_stall_s=0, node_replace_s=0, survivor_stall_s=0, group_restart_s=0, heal_s=0,
             spare_join_s=0, spares=0, live_checkpoint_s=0.5).check()


@pytest.mark.parametrize("field, value", [("restart_s", -1.0), ("spares", -1), ("live_checkpoint_s", 0.0)])
def test_a_negative_recovery_time_or_no_checkpoint_interval_is_refused(field, value):
    with pytest.raises(HardyError, match=rf"recovery times must be >= 0 and the live checkpoint interval > 0 "
                                         rf"\(got {field} = {value}\)"):
        Recovery(**{field: value}).check()
