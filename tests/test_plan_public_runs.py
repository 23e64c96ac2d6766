"""`hardy plan validate`'s published GPU runs: per-source and per-hardware errors, the runs that share a
source with a catalogue constant kept apart, and a leave-one-source-out error that never predicts a run
with a constant fitted to it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import hardy_main
from hardy.plan import public_runs
from hardy.plan.hardware import get_hardware
from hardy.plan.public_runs import PublicRun, RunResult, error_summary, leave_one_source_out, predict, refit


def test_validate_json_reports_the_gpu_runs_by_source():
    proc = hardy_main("plan", "validate", "--json")
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)["gpu_runs"]
    assert len(runs["runs"]) == len(public_runs.RUNS) and set(runs["by_source"]) == set(public_runs.SOURCES)
    assert sum(s["n"] for s in runs["by_source"].values()) == len(runs["runs"])
    # a100-80g's GEMM efficiency comes from Korthikanti et al.'s layer times: their runs are reported apart
    shared = {r["source"] for r in runs["runs"] if r["shares_source_with_a_constant"]}
    assert shared == {"korthikanti-2022"}
    assert runs["independent"]["n"] == len(runs["runs"]) - sum(r["source"] == "korthikanti-2022" for r in runs["runs"])
    assert set(runs["leave_one_source_out"]["refits"]) == {"korthikanti-2022: a100-80g.flops_efficiency"}
    for run in runs["runs"]:
        assert run["error"] == pytest.approx(run["predicted"] / run["published"] - 1)
    # every run in the set ran, so each must be predicted to fit (KempnerForge's 70B on 8 H200s only does
    # as it ran, with no fp32 master weights)
    assert runs["predicted_to_fit"] == len(runs["runs"]) and all(r["fits"] for r in runs["runs"])
    # and the configurations a source reports as out of memory must be predicted not to fit
    oom = runs["out_of_memory"]
    assert [r["case"] for r in oom] == [r.label for r in public_runs.OOM_RUNS] and len(oom) == 2
    assert all(r["published"] == "OOM" and not r["predicted_to_fit"] for r in oom)
    assert all(r["predicted_peak_bytes"] > r["device_bytes"] for r in oom)
    # the same model and layout with full recompute ran (353 tokens/s per GPU): it is predicted to fit
    full = dataclasses.replace(public_runs.OOM_RUNS[0], ac="full")
    assert public_runs.plan_for(full, get_hardware("a100-80g")).fits


def test_error_summary_by_hand():
    run = public_runs.RUNS[0]
    results = [RunResult(run, run.tokens_per_gpu_s * f, True, False) for f in (1.1, 0.8, 1.3)]
    s = error_summary(results)
    assert s["n"] == 3 and s["mape"] == pytest.approx(0.2) and s["mean_error"] == pytest.approx(0.2 / 3)
    assert s["worst"] == pytest.approx(0.3) and s["within_25"] == pytest.approx(2 / 3)


def synthetic_runs(hw, efficiency: float, held_out_factor: float) -> list[PublicRun]:
    """Runs of two sources on one hardware entry: source "a" published exactly what the planner predicts
    at `efficiency`; source "b" published `held_out_factor` times that."""
    base = [PublicRun("a", hw.name, "llama3-8b", 8, 4096, 2, 1, 1.0, "full"),
            PublicRun("a", hw.name, "llama2-13b", 8, 4096, 1, 2, 1.0, "full"),
            PublicRun("b", hw.name, "llama3-8b", 8, 8192, 1, 1, 1.0, "full"),
            PublicRun("b", hw.name, "llama2-13b", 8, 2048, 2, 2, 1.0, "full"),
            PublicRun("b", hw.name, "llama3-8b", 8, 2048, 4, 1, 1.0, "none")]
    at = dataclasses.replace(hw, flops_efficiency=efficiency)
    return [dataclasses.replace(r, tokens_per_gpu_s=predict(r, at)[0] * (held_out_factor if r.source == "b" else 1))
            for r in base]


def test_leave_one_source_out_fits_on_the_other_sources_only(monkeypatch):
    hw = dataclasses.replace(get_hardware("a100-80g"), calibrated_on=(("flops_efficiency", "b"),))
    monkeypatch.setattr(public_runs, "load_catalogue", lambda catalogue=None: {hw.name: hw})
    runs = synthetic_runs(hw, 0.5, held_out_factor=1.25)
    assert refit(hw, "flops_efficiency", runs[:2]) == 0.5
    loso = leave_one_source_out(runs)
    # b's constant is re-derived from a's runs (0.5), not from b's own (which would give 0.5 * 1.25)
    assert loso["refits"] == {"b: a100-80g.flops_efficiency": {"catalogue": hw.flops_efficiency, "refit": 0.5}}
    assert loso["by_source"]["b"]["mean_error"] == pytest.approx(1 / 1.25 - 1)
    # a's constants are not b's: a's runs are predicted with the catalogue's 0.70, not a refit
    at_catalogue = [predict(r, hw)[0] / r.tokens_per_gpu_s - 1 for r in runs[:2]]
    assert loso["by_source"]["a"]["mape"] == pytest.approx(sum(map(abs, at_catalogue)) / 2)


def test_a_constant_with_no_other_source_is_named(monkeypatch):
    hw = dataclasses.replace(get_hardware("a100-80g"), calibrated_on=(("flops_efficiency", "b"),))
    monkeypatch.setattr(public_runs, "load_catalogue", lambda catalogue=None: {hw.name: hw})
    loso = leave_one_source_out([r for r in synthetic_runs(hw, 0.5, 1.0) if r.source == "b"])
    assert loso["unfittable"] == ["a100-80g.flops_efficiency"] and loso["refits"] == {}
