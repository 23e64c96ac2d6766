"""The hardware catalogue (catalogue.toml) and probe profiles as planner `Hardware`."""
from __future__ import annotations

import copy
import json
import re

import pytest

from conftest import run_hardy
from hardy.errors import HardyError
from hardy.plan.hardware import CATALOGUE, describe_hardware, get_hardware, load_catalogue
from hardy.plan.hardware import hardware_from_profile, hardware_from_profile_file

EXPECTED = {"a100-80g", "a100-40g", "h100-sxm", "h100-hbm2e-96gb-500w", "h200", "b200", "gb200", "mi300x", "l40s",
            "xeon-spr", "xeon-emr", "xeon-gnr", "epyc-genoa", "epyc-turin", "graviton4"}


@pytest.fixture(scope="module")
def catalogue():
    return load_catalogue()


def test_every_entry_is_complete(catalogue):
    assert EXPECTED <= set(catalogue)
    for name, hw in catalogue.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) and hw.name == name
        assert hw.kind in ("gpu", "cpu") and hw.description
        assert hw.sources and all(s.strip() for s in hw.sources) and re.match(r"\d{4}-\d{2}", hw.date), name
        assert hw.efficiency_source, name
        assert hw.peak_flops["fp32"] > 0 and hw.peak_flops["bf16"] > hw.peak_flops["fp32"], name
        assert all(v > 0 for v in hw.peak_flops.values()), name
        assert 0 < hw.flops_efficiency <= 1 and 0 < hw.bandwidth_efficiency <= 1, name
        assert hw.memory_bytes > 1e9 and hw.memory_bandwidth > 1e10 and hw.devices_per_node >= 1
        for link in (hw.intra_node, hw.inter_node):
            assert link.name and link.bandwidth > 0 and 0 < link.latency < 1e-3 and 0 < link.efficiency <= 1
        assert hw.intra_node.bandwidth > hw.inter_node.bandwidth, name
        # a price only where one was quoted (parts one cannot rent by the hour have none)
        assert hw.disk_write_bandwidth > 0 and (hw.price_per_device_hour is None or hw.price_per_device_hour > 0)
        assert hw.kind == "cpu" or hw.tdp_w, name  # every GPU has its rated power
        assert hw.fast_bf16, name
        if hw.kind == "cpu":
            assert hw.cores and hw.devices_per_node == 2, name  # one device = one socket
        rows = dict(describe_hardware(hw))
        assert {"peak TFLOP/s (dense)", "memory", "memory bandwidth", "efficiency", "intra-node link",
                "inter-node link", "price", "MTBF", "date"} <= set(rows)


def test_datasheet_figures_match_reference(catalogue):
    a100, h100, h200 = catalogue["a100-80g"], catalogue["h100-sxm"], catalogue["h200"]
    assert a100.peak("bf16") == 312e12 and a100.memory_bytes == 80e9
    assert a100.memory_bandwidth == pytest.approx(2.04e12, rel=1e-3)
    assert a100.intra_node.bandwidth == 300e9 and a100.devices_per_node == 8
    assert h100.peak("bf16") == 989e12 and h100.memory_bandwidth == 3.35e12
    assert h200.peak("bf16") == 989e12 and h200.memory_bytes == 141e9 and h200.memory_bandwidth == 4.8e12
    assert catalogue["b200"].peak("bf16") == 2250e12 and catalogue["mi300x"].memory_bytes == 192e9
    # reference.md: AMX ~115 TF/s per 56-core socket, 307 GB/s (SPR), 461 GB/s (Genoa)
    assert catalogue["xeon-spr"].peak("bf16") == pytest.approx(115e12, rel=0.01)
    assert catalogue["xeon-spr"].memory_bandwidth == pytest.approx(307e9, rel=0.01)
    assert catalogue["epyc-genoa"].memory_bandwidth == pytest.approx(461e9, rel=0.01)


def test_the_entries_added_for_published_runs(catalogue):
    """The H100 torchtitan's benchmarks ran on, GB200 and the 40 GB A100, as their sources give them."""
    grand_teton, sxm = catalogue["h100-hbm2e-96gb-500w"], catalogue["h100-sxm"]
    assert grand_teton.memory_bytes == 96e9 and grand_teton.memory_bandwidth == 2.4e12
    assert grand_teton.inter_node.bandwidth == 50e9 and grand_teton.peak("fp8") == 1978.9e12
    # run at 500 W of its 700 W: the sustained clock goes as the cube root of the power
    assert grand_teton.clock_fraction == pytest.approx((500 / 700) ** (1 / 3))
    in_layer = 0.803 * 0.70 / 0.869  # MAMF x the share of it A100 layers reach
    assert grand_teton.achievable_flops("bf16") == pytest.approx(989.4e12 * in_layer * (500 / 700) ** (1 / 3))
    # torchtitan's notes put this part's peak "between SXM and NVL" (835-989 TF/s bf16): the model agrees
    assert 835e12 < grand_teton.peak("bf16") * grand_teton.clock_fraction < 989.4e12
    assert sxm.clock_fraction == 1.0 and sxm.achievable_flops("bf16") == pytest.approx(989e12 * in_layer)
    gb200 = catalogue["gb200"]
    assert gb200.peak("bf16") == 2500e12 and gb200.peak("fp8") == 5000e12 and gb200.memory_bytes == 186e9
    assert gb200.devices_per_node == 72 and gb200.intra_node.bandwidth == 900e9
    a100 = catalogue["a100-40g"]
    assert a100.memory_bytes == 40e9 and a100.memory_bandwidth == 1555e9 and a100.peak("bf16") == 312e12
    rows = dict(describe_hardware(grand_teton))
    assert rows["power"] == "700 W rated, run at 500 W: sustained clock 0.894 of rated (modelled)"


def test_entries_with_a_best_case_matmul_figure_take_the_in_layer_share_measured_on_the_reference(tmp_path):
    """flops_efficiency = best-case matmul x (the reference's in-layer ÷ best-case), and the constant's
    origin is the reference's source; an entry with both figures keeps its own; no reference: one line."""
    text = CATALOGUE.read_text()
    base = load_catalogue()
    a100, h200, mi300x = base["a100-80g"], base["h200"], base["mi300x"]
    share = a100.flops_efficiency / a100.best_gemm_efficiency
    assert share == pytest.approx(0.70 / 0.869)
    assert h200.flops_efficiency == pytest.approx(0.803 * share) and h200.best_gemm_efficiency == 0.803
    assert mi300x.flops_efficiency == pytest.approx(0.514 * share)
    assert dict(h200.calibrated_on)["flops_efficiency"] == "korthikanti-2022"
    assert base["l40s"].flops_efficiency == 0.70 and base["l40s"].calibrated_on == ()  # its own figure
    # a reference whose layers reach less of its best case lowers every derived entry by as much
    slower = tmp_path / "slower.toml"
    slower.write_text(text.replace("flops_efficiency = 0.70\ncalibrated_on", "flops_efficiency = 0.35\ncalibrated_on", 1))
    changed = load_catalogue(slower)
    assert changed["a100-80g"].flops_efficiency == 0.35
    assert changed["h200"].flops_efficiency == pytest.approx(h200.flops_efficiency / 2)
    assert changed["b200"].flops_efficiency == pytest.approx(base["b200"].flops_efficiency / 2)
    assert "best-case matmul 0.80" in dict(describe_hardware(h200))["efficiency"]
    orphan = tmp_path / "orphan.toml"
    orphan.write_text(text.replace('reference = "a100-80g"', 'reference = "tpu-v9"', 1))
    with pytest.raises(HardyError, match=r"\[hardware.h100-sxm\] gives best_gemm_efficiency") as e:
        load_catalogue(orphan)
    assert "\n" not in str(e.value)
    garbled = tmp_path / "garbled.toml"
    garbled.write_text(text.replace("best_gemm_efficiency = 0.514", 'best_gemm_efficiency = "fast"', 1))
    with pytest.raises(HardyError, match=r"\[mi300x\]: bad GEMM efficiency field") as e:
        load_catalogue(garbled)
    assert "\n" not in str(e.value)


def test_a_power_limit_at_or_above_the_rating_leaves_the_clock(catalogue):
    import dataclasses

    sxm = catalogue["h100-sxm"]
    assert dataclasses.replace(sxm, power_limit_w=700).clock_fraction == 1.0
    assert dataclasses.replace(sxm, power_limit_w=800).clock_fraction == 1.0
    assert dataclasses.replace(sxm, power_limit_w=350).clock_fraction == pytest.approx(0.5 ** (1 / 3))


def test_unknown_hardware_names_the_known_ones():
    with pytest.raises(HardyError) as e:
        get_hardware("tpu-v9")
    msg = str(e.value)
    assert "'tpu-v9'" in msg and "a100-80g" in msg and "graviton4" in msg and "probe:FILE" in msg
    assert "\n" not in msg


def test_malformed_catalogue_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[hardware.x\nkind = ")
    with pytest.raises(HardyError, match="not valid TOML") as e:
        load_catalogue(bad)
    assert "\n" not in str(e.value)
    text = CATALOGUE.read_text()
    missing = tmp_path / "missing.toml"  # the A100 without its memory size
    missing.write_text(text.replace("memory_gb = 80.0\n", "", 1))
    with pytest.raises(HardyError, match=r"\[a100-80g\].*memory_gb") as e:
        load_catalogue(missing)
    assert "\n" not in str(e.value)
    with pytest.raises(HardyError, match="cannot read"):
        load_catalogue(tmp_path / "nope.toml")
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing\n")
    with pytest.raises(HardyError, match="no \\[hardware.NAME\\]"):
        load_catalogue(empty)


def _profile() -> dict:
    """A minimal valid probe profile (the fields hardware_from_profile reads)."""
    return {"schema": "hardy.probe/1", "created": "2026-01-02T03:04:05Z", "hostname": "box",
            "cpu": {"model": "Test CPU", "physical_cores": 8, "memory_total_bytes": 64e9},
            "gpu": None,
            "matmul": {"fast_bf16": False, "dtypes": {"fp32": {"best_flops": 5e11}, "bf16": {"best_flops": 2e9},
                                                      "fp16": {"best_flops": 1e9}}},
            "memory": {"bandwidth": 4e10}, "disk": {"write_bandwidth": 1e9}, "dispatch": {"op_overhead_s": 3e-6},
            "allreduce": {"backend": "gloo", "latency_s": 1e-4, "bus_bandwidth": 3e9}}


def test_profile_mapping():
    hw = hardware_from_profile(_profile())
    assert hw.kind == "cpu" and hw.cores == 8 and hw.devices_per_node == 1 and not hw.fast_bf16
    assert hw.peak("fp32") == 5e11 and hw.achievable_flops("fp32") == 5e11 and hw.memory_bandwidth == 4e10
    assert hw.intra_node.bandwidth == 3e9 and hw.intra_node.latency == 1e-4 and hw.date == "2026-01-02"
    gpu = _profile()
    gpu["gpu"] = {"name": "Test GPU", "count": 4, "memory_bytes": 24e9}
    hw = hardware_from_profile(gpu)
    assert hw.kind == "gpu" and hw.devices_per_node == 4 and hw.memory_bytes == 24e9 and hw.cores is None


@pytest.mark.parametrize("edit, fragment", [
    (lambda p: p.update(schema="hardy.probe/0"), "schema 'hardy.probe/0'"),
    (lambda p: p.pop("schema"), "schema None"),
    (lambda p: p.pop("memory"), "'memory.bandwidth'"),
    (lambda p: p["matmul"]["dtypes"].pop("fp32"), "'matmul.dtypes.fp32.best_flops'"),
    (lambda p: p["disk"].update(write_bandwidth=-1), "'disk.write_bandwidth' must be a positive number"),
    (lambda p: p["allreduce"].update(bus_bandwidth="fast"), "'allreduce.bus_bandwidth'"),
    (lambda p: p.update(allreduce={"backend": "gloo", "error": "timed out"}), "not measured (timed out)"),
])
def test_bad_profile_fields_are_named(edit, fragment):
    p = copy.deepcopy(_profile())
    edit(p)
    with pytest.raises(HardyError) as e:
        hardware_from_profile(p, where="probe profile x.json")
    assert fragment in str(e.value) and str(e.value).startswith("probe profile x.json") and "\n" not in str(e.value)


def test_bad_profile_files(tmp_path):
    cases = {"missing.json": None, "garbage.json": b"\x00\xff\x13binary", "text.json": b"not json {",
             "list.json": b"[1, 2]"}
    for name, data in cases.items():
        path = tmp_path / name
        if data is not None:
            path.write_bytes(data)
        with pytest.raises(HardyError) as e:
            get_hardware(f"probe:{path}")
        assert str(path) in str(e.value) and "\n" not in str(e.value), name
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_profile()))
    assert hardware_from_profile_file(good).name == f"probe:{good}"


def test_probe_out_in_missing_directory_is_exit_2():
    proc = run_hardy("probe", "--quick", "--out", "/nonexistent-dir/x.json")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hardy: error: --out /nonexistent-dir/x.json")
