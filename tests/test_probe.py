"""`hardy probe`: one quick run per session (conftest `probe_profile`), checked for schema and plausibility."""
from __future__ import annotations

import datetime
import json

import psutil
import pytest
import torch

from conftest import run_hardy
from hardy.ops.probe import SCHEMA, measure_allreduce, measure_matmul


@pytest.fixture(scope="module")
def profile(probe_profile) -> dict:
    return json.loads(probe_profile.read_text())


def test_schema_and_description(profile):
    assert profile["schema"] == SCHEMA == "hardy.probe/1"
    assert profile["quick"] is True
    created = datetime.datetime.fromisoformat(profile["created"].replace("Z", "+00:00"))
    assert created.tzinfo is not None and abs(created - datetime.datetime.now(datetime.timezone.utc)).days < 1
    assert profile["torch"] == torch.__version__ and profile["python"] and profile["hostname"]
    assert profile["threads"] == torch.get_num_threads() >= 1
    # --quick is about 30 s on an idle 2-core machine; make test runs two workers, so the other one's
    # tests share the cores while it runs
    assert 0 < profile["duration_s"] < 150
    cpu = profile["cpu"]
    assert cpu["model"] and cpu["physical_cores"] >= 1 and cpu["logical_cpus"] >= cpu["physical_cores"]
    assert {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma"} <= set(cpu["flags"])
    assert all(isinstance(v, bool) for v in cpu["flags"].values())
    assert cpu["memory_total_bytes"] >= cpu["memory_available_bytes"] > 0
    assert profile["gpu"] is None if not torch.cuda.is_available() else profile["gpu"]["count"] >= 1


def test_measurements_are_plausible(profile):
    mm = profile["matmul"]
    assert set(mm["dtypes"]) == {"fp32", "bf16", "fp16"}
    for d in mm["dtypes"].values():
        assert d["sizes"] and d["best_flops"] == max(r["flops"] for r in d["sizes"])
        for r in d["sizes"]:
            assert r["flops"] > 0 and r["seconds"] > 0 and r["multiplies"] >= 2
            assert r["flops"] == pytest.approx(2 * r["size"] ** 3 / r["seconds"])
    assert mm["dtypes"]["fp32"]["best_flops"] > 1e9
    assert profile["memory"]["bandwidth"] > 0.5e9
    assert profile["memory"]["bytes_per_copy"] == 2 * profile["memory"]["buffer_bytes"]
    disk = profile["disk"]
    assert disk["write_bandwidth"] > 1e6 and disk["read_bandwidth"] > 1e6 and disk["file_bytes"] == 64 << 20
    assert isinstance(disk["read_cache_dropped"], bool)
    assert 0 < profile["dispatch"]["op_overhead_s"] < 1e-3
    ar = profile["allreduce"]
    assert "error" not in ar, ar
    assert ar["processes"] == 2 and ar["threads_per_process"] == 1
    sizes = [r["bytes"] for r in ar["sizes"]]
    assert sizes == sorted(sizes) and sizes[0] == 4 << 10 and sizes[-1] == 64 << 20
    assert 0 < ar["latency_s"] < 1.0 and ar["latency_s"] == ar["sizes"][0]["seconds"]
    last = ar["sizes"][-1]
    assert ar["bus_bandwidth"] == pytest.approx(last["bytes"] / last["seconds"])  # 2(n-1)/n = 1 for n = 2
    assert ar["bus_bandwidth"] > 1e6


def test_slow_dtypes_are_sized_down(profile):
    """A dtype without native support (bf16 on AVX2, fp16 on most CPUs) must never be tried large."""
    mm = profile["matmul"]
    fp32 = mm["dtypes"]["fp32"]["best_flops"]
    if not mm["fast_bf16"]:
        assert max(r["size"] for r in mm["dtypes"]["bf16"]["sizes"]) < 1024
    for name, d in mm["dtypes"].items():
        assert max(r["seconds"] for r in d["sizes"]) < 2.0, name
        if d["best_flops"] < 0.1 * fp32 and profile["device"] == "cpu":
            assert max(r["size"] for r in d["sizes"]) < 1024, name
    assert max(r["size"] for r in mm["dtypes"]["fp32"]["sizes"]) <= 1024  # --quick skips 2048


def test_profile_loads_as_hardware(probe_profile, profile):
    from hardy.cli.probe import table
    from hardy.plan.hardware import describe_hardware, get_hardware

    hw = get_hardware("probe:" + str(probe_profile))
    assert hw.name == f"probe:{probe_profile}" and hw.kind == ("gpu" if profile["gpu"] else "cpu")
    for dtype in ("fp32", "bf16", "fp16"):
        assert hw.peak(dtype) == profile["matmul"]["dtypes"][dtype]["best_flops"]
    assert hw.flops_efficiency == profile["training_gemm"]["efficiency"] and hw.bandwidth_efficiency == 1.0
    assert 0 < hw.flops_efficiency <= 1 and hw.elementwise_rate() == profile["elementwise"]["bandwidth"]
    assert hw.decode_rate() == profile["gemv"]["bandwidth"] > 0
    assert len(profile["training_gemm"]["efficiency_by_width"]) >= 2
    # the planner's GEMM rates are a real layer's (all its matmuls, forward + backward), by width
    gemm = {int(w): e for w, e in profile["layer_gemm"]["efficiency_by_width"].items()}
    assert sorted(gemm) == [64, 256, 576, 1536] and all(0 < e <= 1 for e in gemm.values())
    assert hw.gemm_rate("fp32", min(gemm)) == pytest.approx(hw.peak("fp32") * gemm[min(gemm)])
    assert hw.gemm_rate("fp32", 1 << 20) == pytest.approx(hw.peak("fp32") * gemm[max(gemm)])
    # and the inference forward's projections alone (prefill, re-ranking), apart
    forward = {int(w): e for w, e in profile["layer_gemm_forward"]["efficiency_by_width"].items()}
    assert sorted(forward) == sorted(gemm) and all(0 < e <= 1 for e in forward.values())
    assert hw.gemm_rate("fp32", 576, forward=True) == pytest.approx(hw.peak("fp32") * forward[576])
    attn = {int(h): e for h, e in profile["attention"]["efficiency_by_head_dim"].items()}
    assert set(attn) == {16, 32, 64, 128} and all(0 < e <= 1 for e in attn.values())
    assert hw.attention_rate("fp32", 16) == pytest.approx(hw.peak("fp32") * attn[16])
    low, high = sorted((attn[32], attn[64]))
    assert low * hw.peak("fp32") <= hw.attention_rate("fp32", 48) <= high * hw.peak("fp32") * (1 + 1e-9)
    el = profile["elementwise"]
    assert el["bytes"] > 0 and el["ops"] > 20 and el["bandwidth"] > 1e8
    by_width = {int(w): r for w, r in profile["gemv"]["bandwidth_by_width"].items()}
    assert hw.decode_rate(576) == by_width[576] and hw.decode_rate(100_000) == by_width[4096]
    assert min(by_width.values()) <= hw.decode_rate(1000) <= max(by_width.values())
    quant = profile["quant_gemv"]  # hardy probe hands the kernels' steps to the probe
    q_width = {int(w): r for w, r in quant["bandwidth_by_width"].items()}
    assert sorted(q_width) == [1024, 2048, 4096] and quant["bandwidth"] == q_width[4096] > 0
    assert hw.decode_rate(2048, quantized=True) == q_width[2048]  # the model's width, not the 4096 figure
    assert min(q_width.values()) <= hw.decode_rate(3000, quantized=True) <= max(q_width.values())
    assert quant["expert_bytes"] == 8 * 3 * 2048 * 768 * 18 // 32  # 8 experts' gate, up, down at Q4_0's bytes
    # decode rates are DRAM rates: every matrix and the experts together exceed the caches
    from hardy.ops.kernel_probe import dram_bytes, last_level_cache_bytes

    for nbytes in (quant["bytes"], profile["gemv"]["bytes"],
                   quant["expert_shape"]["experts"] * quant["expert_bytes"] // 8):
        assert nbytes >= min(dram_bytes(), 2 * last_level_cache_bytes()) and nbytes >= 256 << 20
    assert hw.expert_rate(2048, quantized=True) == quant["expert_bandwidth"] > 0
    assert hw.expert_rate(2048) == hw.decode_rate(2048)  # float weights: no grouped kernel
    tr = profile["training_runtime"]
    assert "error" not in tr, tr
    assert hw.runtime_overhead_bytes == tr["runtime_overhead_bytes"] >= 0
    assert hw.distributed_runtime_overhead_bytes == tr["distributed_runtime_overhead_bytes"] >= 0
    assert tr["peak_bytes_1proc"] > 0 and tr["predicted_tensor_bytes_1proc"] > 0
    assert hw.achievable_bandwidth() == profile["memory"]["bandwidth"]
    assert hw.intra_node.bandwidth == profile["allreduce"]["bus_bandwidth"]
    assert hw.intra_node.latency == profile["allreduce"]["latency_s"] and hw.intra_node.efficiency == 1.0
    assert hw.inter_node.bandwidth == hw.intra_node.bandwidth and hw.inter_node.name != hw.intra_node.name
    assert hw.disk_write_bandwidth == profile["disk"]["write_bandwidth"]
    assert hw.op_overhead_s == profile["dispatch"]["op_overhead_s"]
    assert hw.fast_bf16 is profile["matmul"]["fast_bf16"] and hw.price_per_device_hour is None
    if hw.kind == "cpu":
        assert hw.cores == profile["cpu"]["physical_cores"] and hw.devices_per_node == 1
        assert hw.memory_bytes == profile["cpu"]["memory_total_bytes"]
    assert hw.sources == (f"hardy probe {profile['created']}",) and hw.date == profile["created"][:10]
    assert "measured" in hw.efficiency_source
    assert dict(describe_hardware(hw))["date"] == hw.date
    assert any(k.startswith("matmul fp32") for k, _ in table(profile))
    # the fp8 GEMM: measured where torch can run it, planned only where it is not emulated
    mm = profile["matmul"]
    fp8, rows = mm["fp8"], dict(table(profile))
    assert ("fp8" in hw.peak_flops) is mm["fast_fp8"]
    if "skipped" in fp8:
        assert not mm["fast_fp8"] and rows["matmul fp8 GFLOP/s"] == f"not measured: {fp8['skipped']}"
    else:
        assert fp8["best_flops"] == max(r["flops"] for r in fp8["sizes"]) and max(r["seconds"] for r in fp8["sizes"]) < 2
        assert mm["fast_fp8"] is (profile["device"] == "cuda" or fp8["best_flops"] >= 0.5 * mm["dtypes"]["fp32"]["best_flops"])
        assert rows["matmul fp8 GFLOP/s"].startswith("best ") and ("emulated" in rows["matmul fp8 GFLOP/s"]) is not mm["fast_fp8"]


def test_matmul_stops_growing_when_the_next_size_would_be_slow():
    r = measure_matmul(torch.float32, torch.device("cpu"), [64, 128, 256], min_time=0.0, max_single=0.0)
    assert [x["size"] for x in r["sizes"]] == [64] and "would take" in r["stopped"]
    r = measure_matmul(torch.float32, torch.device("cpu"), [32, 64], min_time=0.0, max_single=10.0)
    assert [x["size"] for x in r["sizes"]] == [32, 64]


def test_allreduce_timeout_kills_the_workers():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    r = measure_allreduce(quick=True, timeout=0.5)  # far too short even to import torch
    assert "did not finish" in r["error"]
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_bad_dir_is_one_line_error(tmp_path):
    proc = run_hardy("probe", "--quick", "--out", str(tmp_path / "p.json"), "--dir", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("hardy: error: --dir")
    assert not (tmp_path / "p.json").exists()


def test_gemm_timer_counts_the_flops_of_every_matmul_a_layer_runs():
    from hardy.ops.kernel_probe import GemmTimer

    x, w, b = torch.randn(24, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True), torch.randn(40)
    timer = GemmTimer(torch.device("cpu"))
    with timer:
        (torch.nn.functional.linear(x, w, b).relu() @ torch.randn(40, 8)).sum().backward()
    # forward 24x16x40 (addmm) + 24x40x8; backward: dx, dW of both (the second's dW only)
    expected = 2 * (24 * 16 * 40 + 24 * 40 * 8) + 2 * (24 * 40 * 16 + 40 * 24 * 16) + 2 * (24 * 8 * 40)
    assert timer.flops == expected and timer.seconds > 0


def test_decode_rates_are_measured_on_more_bytes_than_the_caches_hold(tmp_path):
    """The last-level cache is read from sysfs (K/M suffixes, the largest level), and the working set
    is twice it, at least 256 MiB, at most 1 GiB: a 300 MiB L3 measured at 64 MiB read ~54 GB/s where
    DRAM gives ~29."""
    from hardy.ops.kernel_probe import dram_bytes, last_level_cache_bytes

    for index, size in enumerate(("48K", "32K", "2048K", "300M")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 300 << 20
    assert last_level_cache_bytes(tmp_path / "absent") == 0
    assert dram_bytes(cache=300 << 20) == 600 << 20
    assert dram_bytes(cache=32 << 20) == 256 << 20 and dram_bytes(cache=0) == 256 << 20
    assert dram_bytes(cache=2 << 30) == 1 << 30


def test_the_mfu_basis_is_measured_once_per_machine_dtype_and_thread_count(tmp_path, monkeypatch):
    """A restarted run does not spend seconds measuring the matmul again: the first measurement is kept
    in HARDY_CACHE/matmul; another dtype or thread count is measured anew; an unreadable record is
    measured again and replaced."""
    from hardy.ops import matmul_probe

    monkeypatch.setenv("HARDY_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(matmul_probe, "measure_matmul_flops",
                        lambda dtype, device: measured.append((dtype, torch.get_num_threads())) or 1e9 * len(measured))
    threads = torch.get_num_threads()
    first = matmul_probe.cached_matmul_flops(torch.float32, "cpu")
    again = matmul_probe.cached_matmul_flops(torch.float32, "cpu")
    assert first == (1e9, None) and again == (1e9, datetime.date.today().isoformat())
    assert matmul_probe.cached_matmul_flops(torch.bfloat16, "cpu") == (2e9, None)
    try:
        torch.set_num_threads(threads + 1)
        assert matmul_probe.cached_matmul_flops(torch.float32, "cpu") == (3e9, None)
    finally:
        torch.set_num_threads(threads)
    records = list((tmp_path / "matmul").glob("*.json"))
    assert len(records) == 3 and measured == [(torch.float32, threads), (torch.bfloat16, threads),
                                              (torch.float32, threads + 1)]
    for record in records:
        record.write_text('{"flops": ')  # a write cut short
    assert matmul_probe.cached_matmul_flops(torch.float32, "cpu") == (4e9, None)
    assert matmul_probe.cached_matmul_flops(torch.float32, "cpu")[0] == 4e9 and len(measured) == 4
