"""Health telemetry (psutil on this machine, NVML through a stand-in module) and straggler detection
across two real processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types

import pytest

from conftest import REPO
from hardy.fault.straggler import find_stragglers
from hardy.ops.telemetry import GpuSensors, HealthWarnings, TelemetrySampler, Thresholds, take_sample
from trainutil import BASE, launch, read_records


def test_host_telemetry_reports_real_values_and_names_what_is_missing(tmp_path):
    s = take_sample(tmp_path, None)
    assert s["rss_bytes"] > 10 * 2**20 and s["disk_free_bytes"] > 0 and s["load_1m"] >= 0
    assert s["swap_total_bytes"] >= s["swap_used_bytes"] >= 0
    assert set(s["absent"]) == {k for k, v in s.items() if v is None}
    for key in ("cpu_freq_mhz", "cpu_temp_c"):  # present with a real reading, or absent: never 0
        assert key in s["absent"] or s[key] > 0


def test_sampler_runs_in_the_background_and_hands_each_sample_over(tmp_path):
    got = []
    sampler = TelemetrySampler(tmp_path, 0.1, lambda sample, warnings: got.append(sample)).start()
    try:
        for _ in range(100):
            if len(got) >= 3:
                break
            time.sleep(0.05)
    finally:
        sampler.stop()
    assert len(got) >= 3 and sampler.latest is got[-1] and got[0]["time"] < got[-1]["time"]


class FakeNVMLError(Exception):
    pass


def fake_nvml(temps: list[int], ecc: list[int | None], reasons: int = 0, xids: tuple[int, ...] = ()) -> types.ModuleType:
    """pynvml's calls as hardy.ops.telemetry makes them, for a GPU with the given readings over time;
    what is None is unsupported (raises NVMLError, as the real module does)."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    constants = {"NVML_TEMPERATURE_GPU": 0, "NVML_CLOCK_SM": 1, "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0,
                 "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1, "NVML_VOLATILE_ECC": 0, "NVML_PCIE_UTIL_TX_BYTES": 0,
                 "NVML_PCIE_UTIL_RX_BYTES": 1, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
                 "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1}  # nvml.h's values
    for name, value in constants.items():
        setattr(m, name, value)
    m.nvmlEventTypeXidCriticalError = 8
    state = m.state = {"t": 0, "xids": list(xids)}  # the test may queue Xid events later

    def unsupported(*_):
        raise FakeNVMLError("Not Supported")

    def ecc_errors(handle, kind, counter):
        value = ecc[min(state["t"] - 1, len(ecc) - 1)]  # the sample's temperature is read first
        if value is None:
            raise FakeNVMLError("Not Supported")
        return value if kind == m.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def temperature(handle, sensor):
        state["t"] += 1
        return temps[min(state["t"] - 1, len(temps) - 1)]

    def wait(events, timeout_ms):
        if not state["xids"]:
            raise FakeNVMLError("Timeout")
        return types.SimpleNamespace(eventData=state["xids"].pop(0))

    m.nvmlInit = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    m.nvmlEventSetCreate = lambda: "events"
    m.nvmlDeviceRegisterEvents = lambda handle, kinds, events: None
    m.nvmlEventSetWait_v2 = wait
    m.nvmlDeviceGetTemperature = temperature
    m.nvmlDeviceGetPowerUsage = lambda h: 612_000
    m.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    m.nvmlDeviceGetClockInfo = lambda h, c: 1410
    m.nvmlDeviceGetMaxClockInfo = lambda h, c: 1980
    m.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=70 * 2**30)
    m.nvmlDeviceGetTotalEccErrors = ecc_errors
    m.nvmlDeviceGetRemappedRows = lambda h: (1, 0, 0, 0)
    m.nvmlDeviceGetPcieThroughput = lambda h, c: 2500
    m.nvmlDeviceGetFieldValues = unsupported  # no NVLink on this one
    return m


def test_nvml_readings_decoded_with_unsupported_ones_absent(tmp_path):
    nvml = fake_nvml(temps=[70], ecc=[None], reasons=0x40 | 0x1)  # thermal (hw) slowdown, and idle (ignored)
    s = take_sample(tmp_path, GpuSensors(nvml, 0))
    assert (s["gpu_temp_c"], s["power_w"], s["power_limit_w"], s["sm_clock_mhz"]) == (70, 612, 700, 1410)
    assert s["throttle"] == ["thermal (hw)"] and s["gpu_memory_used_bytes"] == 70 * 2**30
    assert s["remapped_rows"] == 1 and s["retired_pages"] is None and s["pcie_tx_bytes_s"] == 2_500_000
    assert s["ecc_corrected"] is None and s["nvlink_tx_kib"] is None and s["xid"] == []
    assert {"ecc_corrected", "ecc_uncorrected", "nvlink_tx_kib", "nvlink_rx_kib", "retired_pages"} <= set(s["absent"])
    assert "gpu_temp_c" not in s["absent"]


def test_warnings_fire_once_per_crossing_and_on_every_new_error(tmp_path):
    nvml = fake_nvml(temps=[80, 90, 91, 70, 88], ecc=[0, 0, 2, 2, 2])
    gpu = GpuSensors(nvml, 0)
    warnings = HealthWarnings(Thresholds(gpu_temp_c=85, disk_free_gib=0))
    fired = []
    for i in range(5):
        if i == 2:
            nvml.state["xids"].append(79)
        fired.append(warnings.check(take_sample(tmp_path, gpu)))
    assert fired[0] == [] and len(fired[1]) == 1 and "90 C" in fired[1][0]  # crossed
    assert any("ecc corrected grew from 0 to 2" in w for w in fired[2]) and any("Xid error(s) 79" in w for w in fired[2])
    assert not any("C (warning" in w for w in fired[2])  # still hot: not repeated
    assert fired[3] == [] and len(fired[4]) == 1 and "88 C" in fired[4][0]  # cooled, re-armed, crossed again


def test_low_disk_and_swap_growth_warn(tmp_path):
    warnings = HealthWarnings(Thresholds(disk_free_gib=1e9, swap_growth_mib=100))
    first = take_sample(tmp_path, None)
    assert any("free in the run directory" in w for w in warnings.check(first))
    grown = {**first, "swap_used_bytes": first["swap_used_bytes"] + 200 * 2**20}
    assert any("swapping" in w for w in warnings.check(grown))


def test_straggler_rule_compares_each_rank_with_the_median_of_the_others():
    assert find_stragglers([1.0, 2.1], 1.5) == [(1, 2.1)]
    assert find_stragglers([1.0, 1.1, 0.9, 1.05], 1.5) == []
    assert [r for r, _ in find_stragglers([1.0, 1.0, 1.0, 3.0, 1.0], 1.5)] == [3]


def test_two_processes_telemetry_and_no_false_straggler_in_200_steps(tmp_path, micro_dataset):
    run = tmp_path / "run"
    launch(run, micro_dataset, 2, "train.steps=200", "log.every=100", "health.straggler_every=20",
           "health.telemetry_interval_s=0.5", timeout=300)
    records = read_records(run)
    windows = [r for r in records if r["event"] == "rank_times"]
    assert len(windows) == 10 and all(len(w["ranks"]) == 2 for w in windows)
    assert all(w["ranks"][r]["compute_s"] > 0 for w in windows for r in (0, 1))
    assert [r for r in records if r["event"] == "straggler"] == []
    telemetry = [r for r in records if r["event"] == "telemetry"]
    assert telemetry and all(t["rss_bytes"] > 0 for t in telemetry)
    rank1 = [json.loads(line) for line in (run / "telemetry_rank1.jsonl").read_text().splitlines()]
    assert rank1 and rank1[0]["rss_bytes"] > 0


def test_injected_slow_rank_is_named_in_its_window_and_a_persistent_one_stops_the_job(tmp_path, micro_dataset):
    run = tmp_path / "run"
    sets = [*BASE, f"data.path={micro_dataset}", "train.threads=1", "train.steps=120", "health.straggler_every=10",
            "health.straggler_stop_after=3", "health.telemetry_interval_s=0.5", "fault.inject=slow@rank1:3x@31-120"]
    (tmp_path / "empty.toml").write_text("# every value comes from --set\n")
    cmd = [sys.executable, "-m", "hardy", "launch", "--nproc", "2", "--max-restarts", "0", "--run-dir", str(run),
           str(tmp_path / "empty.toml"), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    records = read_records(run)
    named = [r for r in records if r["event"] == "straggler"]
    assert [r["steps"] for r in named] == [[31, 40], [41, 50], [51, 60]] and {r["rank"] for r in named} == {1}
    assert all(r["ratio"] > 2 for r in named) and named[0]["ranks"][1]["telemetry"]["rss_bytes"] > 0
    assert not [r for r in records if r["event"] == "straggler" and r["steps"][0] <= 30]
    assert "straggler: rank 1 took" in proc.stdout
    assert "rank 1 was a straggler" in proc.stdout + proc.stderr and "3 windows in a row" in proc.stdout + proc.stderr
    # stopped at the end of step 60, the third window's last, before its step record
    assert max(r["step"] for r in records if r["event"] == "step") == 59


def test_a_reading_the_binding_lacks_is_absent_and_a_failing_decoder_is_not_hidden(tmp_path):
    """A call missing from an older nvidia-ml-py is an absent reading; an AttributeError raised while a
    present call runs is a defect, and it surfaces instead of reading as "unsupported"."""
    nvml = fake_nvml(temps=[70], ecc=[3])
    del nvml.nvmlDeviceGetPcieThroughput  # this binding predates the call
    s = take_sample(tmp_path, GpuSensors(nvml, 0))
    assert s["pcie_tx_bytes_s"] is None and "pcie_tx_bytes_s" in s["absent"] and s["gpu_temp_c"] == 70

    def broken(handle):
        return types.SimpleNamespace().used  # a decoding bug: AttributeError from inside the call

    nvml.nvmlDeviceGetMemoryInfo = broken
    with pytest.raises(AttributeError):
        take_sample(tmp_path, GpuSensors(nvml, 0))


def test_the_stand_in_and_the_telemetry_agree_with_the_real_nvml_binding():
    """The stand-in above is checked against nvidia-ml-py itself (pure Python: it imports without a GPU),
    not against the code it tests: every name it provides exists in the real binding with the same
    value or the same number of arguments, every NVML call and constant the telemetry uses exists there,
    and the throttle bits and NVLink field ids hardy decodes are the binding's own."""
    import ast
    import inspect

    import pynvml

    from hardy.ops import telemetry

    fake = fake_nvml(temps=[70], ecc=[0])
    for name, value in vars(fake).items():
        if name.startswith("__") or name in ("state", "NVMLError"):
            continue
        real = getattr(pynvml, name, None)
        assert real is not None, f"the stand-in's {name} is not in nvidia-ml-py"
        if callable(value):
            fake_params = inspect.signature(value).parameters.values()
            if any(p.kind is p.VAR_POSITIONAL for p in fake_params):
                continue
            required = [p for p in inspect.signature(real).parameters.values() if p.default is p.empty]
            assert len(list(fake_params)) == len(required), name
        else:
            assert value == real, f"{name}: the stand-in has {value}, nvidia-ml-py {real}"
    assert issubclass(pynvml.NVMLError, Exception)

    source = ast.parse(inspect.getsource(telemetry))
    called = {n.args[0].value for n in ast.walk(source) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") ==
              "_read" and isinstance(n.args[0], ast.Constant)}
    attributes = {n.attr for n in ast.walk(source) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id in ("n", "nvml") and n.attr.startswith(("nvml", "NVML"))}
    assert len(called) >= 10 and len(attributes) >= 8
    missing = sorted(name for name in called | attributes if not hasattr(pynvml, name))
    assert not missing, f"the telemetry uses names nvidia-ml-py does not have: {missing}"
    reasons = {getattr(pynvml, n): n for n in dir(pynvml) if n.startswith("nvmlClocksEventReason")}
    assert {bit: reasons[bit] for bit in telemetry.THROTTLE_BITS} == {
        0x4: "nvmlClocksEventReasonSwPowerCap", 0x8: "nvmlClocksEventReasonHwSlowdown",
        0x20: "nvmlClocksEventReasonSwThermalSlowdown", 0x40: "nvmlClocksEventReasonHwThermalSlowdown",
        0x80: "nvmlClocksEventReasonHwPowerBrakeSlowdown"}
    assert (telemetry.NVLINK_TX, telemetry.NVLINK_RX) == (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                                                        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)


def test_on_cuda_a_step_is_timed_by_the_gpus_events_not_the_host_clock(monkeypatch):
    """Kernels run asynchronously: the host reaches the step's all-reduce long before a slow GPU has
    finished. The monitor's compute time is the GPU's, from events recorded on the stream at the step's
    start and where its compute ends (their elapsed time, read after the step's read-back)."""
    import torch

    from hardy.fault.straggler import StragglerMonitor

    recorded = []

    class Event:  # torch.cuda.Event's calls as the monitor makes them
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = len(recorded) * 0.25  # the GPU's clock: each record a quarter second on
            recorded.append(self)

        def elapsed_time(self, end) -> float:
            assert self.at is not None and end.at is not None
            return 1000 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monitor = StragglerMonitor(100, 1.5, 0, torch.device("cuda"), lambda: None, lambda *a: None)
    monitor.before_step(1)
    monitor.compute_done()
    monitor.after_step(1)
    assert monitor.compute == [0.25] and len(recorded) == 2
    assert monitor.wait[0] == 0.0  # the host took no time at all, the GPU a quarter second
    # a CPU step is still timed by the CPU seconds of torch's threads
    cpu = StragglerMonitor(100, 1.5, 0, torch.device("cpu"), lambda: None, lambda *a: None)
    cpu.before_step(1)
    cpu.after_step(1)
    assert len(recorded) == 2 and cpu.compute[0] < 0.25
