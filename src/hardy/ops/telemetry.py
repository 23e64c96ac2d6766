"""Health telemetry: what the host (psutil) and the GPU (NVML) report, sampled in a background thread.

A sensor this machine does not have is `None` in the sample and named in its `absent` list, never 0:
a GPU without ECC has no ECC count, a VM without thermal zones has no CPU temperature. Warnings fire
once when a threshold is crossed and re-arm when the reading is back below it (docs/metrics.md).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

log = logging.getLogger(__name__)

# NVML's clock event ("throttle") reasons that mean the GPU is running slower than asked, by bit
# (nvml.h: nvmlClocksEventReason*); idle, application clocks and sync boost are not slowdowns.
THROTTLE_BITS = {0x4: "power cap", 0x8: "hw slowdown", 0x20: "thermal (sw)", 0x40: "thermal (hw)",
                 0x80: "power brake"}
# NVML field ids of NVLink data throughput (KiB, cumulative over all links; nvml.h NVML_FI_DEV_*)
NVLINK_TX, NVLINK_RX = 138, 139
CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "acpitz")


@dataclass(frozen=True)
class Thresholds:
    gpu_temp_c: float = 85.0
    cpu_temp_c: float = 95.0
    swap_growth_mib: float = 256.0  # swap in use grown by this much since the first sample
    disk_free_gib: float = 5.0  # free space in the run directory


def _cpu_temperature() -> float | None:
    read = getattr(psutil, "sensors_temperatures", None)
    try:
        sensors = read() if read else {}
    except (OSError, RuntimeError):
        return None
    readings = [t.current for name in CPU_SENSORS for t in sensors.get(name, []) if t.current is not None]
    if not readings:  # an unnamed chip: the hottest reading is the one that matters
        readings = [t.current for ts in sensors.values() for t in ts if t.current is not None]
    return max(readings) if readings else None


def host_sample(run_dir: Path) -> dict:
    """CPU frequency, load, this process's RSS, swap, CPU temperature and free disk of the run dir."""
    try:
        freq = psutil.cpu_freq()
    except (OSError, RuntimeError, NotImplementedError):
        freq = None
    swap = psutil.swap_memory()
    return {
        "cpu_freq_mhz": freq.current if freq is not None and freq.current > 0 else None,
        "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "rss_bytes": psutil.Process().memory_info().rss,
        "swap_total_bytes": swap.total,
        "swap_used_bytes": swap.used,
        "cpu_temp_c": _cpu_temperature(),
        "disk_free_bytes": shutil.disk_usage(run_dir).free,
    }


class GpuSensors:
    """One GPU's NVML readings. `nvml` is the `pynvml` module (nvidia-ml-py), or a stand-in in tests."""

    def __init__(self, nvml, index: int, uuid: str | None = None):
        self.nvml, self.index = nvml, index
        nvml.nvmlInit()
        # by UUID where known: NVML numbers GPUs without regard to CUDA_VISIBLE_DEVICES
        self.handle = nvml.nvmlDeviceGetHandleByUUID(uuid) if uuid else nvml.nvmlDeviceGetHandleByIndex(index)
        self.events = None
        try:  # Xid errors arrive as events; drivers that do not expose them leave `xid` absent
            self.events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self.handle, nvml.nvmlEventTypeXidCriticalError, self.events)
        except nvml.NVMLError:
            self.events = None

    def _read(self, name: str, *args):
        call = getattr(self.nvml, name, None)  # absent from an older nvidia-ml-py: not read
        if call is None:
            return None
        try:
            return call(self.handle, *args)
        except self.nvml.NVMLError:  # not supported by this GPU or driver
            return None

    def _xids(self) -> list[int] | None:
        if self.events is None:
            return None
        found = []
        while True:
            try:
                event = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError:  # timeout: no (more) events
                return found
            found.append(int(event.eventData))

    def sample(self) -> dict:
        n = self.nvml
        power, limit = self._read("nvmlDeviceGetPowerUsage"), self._read("nvmlDeviceGetEnforcedPowerLimit")
        reasons = self._read("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            reasons = self._read("nvmlDeviceGetCurrentClocksThrottleReasons")  # its name before NVML 12.2
        memory = self._read("nvmlDeviceGetMemoryInfo")
        remapped = self._read("nvmlDeviceGetRemappedRows")  # (corrected, uncorrected, pending, failed): Ampere on
        retired = None
        if remapped is None:  # older GPUs retire pages instead
            pages = [self._read("nvmlDeviceGetRetiredPages", cause) for cause in (
                n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
            retired = None if any(p is None for p in pages) else sum(len(p) for p in pages)
        nvlink = self._read("nvmlDeviceGetFieldValues", [NVLINK_TX, NVLINK_RX])
        nvlink = [v for v in (nvlink or []) if getattr(v, "nvmlReturn", 1) == 0]
        pcie_tx = self._read("nvmlDeviceGetPcieThroughput", n.NVML_PCIE_UTIL_TX_BYTES)  # KB/s, a 20 ms window
        pcie_rx = self._read("nvmlDeviceGetPcieThroughput", n.NVML_PCIE_UTIL_RX_BYTES)
        return {
            "gpu": self.index,
            "gpu_temp_c": self._read("nvmlDeviceGetTemperature", n.NVML_TEMPERATURE_GPU),
            "power_w": None if power is None else power / 1000,
            "power_limit_w": None if limit is None else limit / 1000,
            "sm_clock_mhz": self._read("nvmlDeviceGetClockInfo", n.NVML_CLOCK_SM),
            "sm_clock_max_mhz": self._read("nvmlDeviceGetMaxClockInfo", n.NVML_CLOCK_SM),
            "throttle": None if reasons is None else [why for bit, why in THROTTLE_BITS.items() if reasons & bit],
            "gpu_memory_used_bytes": None if memory is None else int(memory.used),
            "ecc_corrected": self._read("nvmlDeviceGetTotalEccErrors", n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                        n.NVML_VOLATILE_ECC),  # since the driver loaded
            "ecc_uncorrected": self._read("nvmlDeviceGetTotalEccErrors", n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                          n.NVML_VOLATILE_ECC),
            "remapped_rows": None if remapped is None else int(remapped[0]) + int(remapped[1]),
            "retired_pages": retired,
            "pcie_tx_bytes_s": None if pcie_tx is None else pcie_tx * 1000,
            "pcie_rx_bytes_s": None if pcie_rx is None else pcie_rx * 1000,
            "nvlink_tx_kib": nvlink[0].value.ullVal if len(nvlink) == 2 else None,
            "nvlink_rx_kib": nvlink[1].value.ullVal if len(nvlink) == 2 else None,
            "xid": self._xids(),
        }


def open_gpu_sensors(device_index: int | None, uuid: str | None = None, nvml=None) -> GpuSensors | None:
    """NVML for this process's GPU; None on a CPU run or where NVML cannot start (no driver)."""
    if device_index is None:
        return None
    if nvml is None:
        try:
            import pynvml as nvml  # optional: the `gpu` extra (nvidia-ml-py), only on GPU machines
        except ImportError:
            log.warning("telemetry: nvidia-ml-py is not installed: no GPU sensors (pip install 'hardy[gpu]')")
            return None
    try:
        return GpuSensors(nvml, device_index, uuid)
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no sensors
        log.warning("telemetry: NVML did not start (%s): no GPU sensors", e)
        return None


def device_sensors(device) -> GpuSensors | None:
    """NVML for a torch device (None on CPU): found by UUID, so CUDA_VISIBLE_DEVICES cannot mislead it."""
    if device.type != "cuda":
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return open_gpu_sensors(device.index or 0, f"GPU-{uuid}" if uuid else None)


def take_sample(run_dir: Path, gpu: GpuSensors | None) -> dict:
    sample = host_sample(run_dir)
    if gpu is not None:
        sample.update(gpu.sample())
    sample["absent"] = sorted(k for k, v in sample.items() if v is None)
    return sample


class HealthWarnings:
    """Threshold crossings as one-line warnings: each fires when a condition starts, and re-arms when
    it ends; new ECC errors, remapped rows, retired pages and Xids fire every time they grow."""

    COUNTERS = ("ecc_corrected", "ecc_uncorrected", "remapped_rows", "retired_pages")

    def __init__(self, limits: Thresholds):
        self.limits, self.active, self.first, self.last = limits, set(), None, {}

    def check(self, s: dict) -> list[str]:
        lim, out = self.limits, []
        if self.first is None:
            self.first = s
        swap_growth = (s["swap_used_bytes"] - self.first["swap_used_bytes"]) / 2**20
        conditions = {
            "gpu_temp": (s.get("gpu_temp_c") is not None and s["gpu_temp_c"] >= lim.gpu_temp_c,
                         f"GPU {s.get('gpu')} at {s.get('gpu_temp_c')} C (warning at {lim.gpu_temp_c:g} C)"),
            "cpu_temp": (s["cpu_temp_c"] is not None and s["cpu_temp_c"] >= lim.cpu_temp_c,
                         f"CPU at {s['cpu_temp_c']} C (warning at {lim.cpu_temp_c:g} C)"),
            "throttle": (bool(s.get("throttle")),
                         f"GPU {s.get('gpu')} clocks held down: {', '.join(s.get('throttle') or [])} "
                         f"(SM {s.get('sm_clock_mhz')} of {s.get('sm_clock_max_mhz')} MHz)"),
            "swap": (swap_growth >= lim.swap_growth_mib,
                     f"swapping: {swap_growth:,.0f} MiB more swap in use than at the start (the host is out of memory)"),
            "disk": (s["disk_free_bytes"] < lim.disk_free_gib * 2**30,
                     f"{s['disk_free_bytes'] / 2**30:.1f} GiB free in the run directory "
                     f"(warning below {lim.disk_free_gib:g} GiB): checkpoints may fail"),
        }
        for key, (on, text) in conditions.items():
            if on and key not in self.active:
                out.append(text)
            (self.active.add if on else self.active.discard)(key)
        for key in self.COUNTERS:
            now, before = s.get(key), self.last.get(key)
            if now is not None and before is not None and now > before:
                out.append(f"GPU {s.get('gpu')}: {key.replace('_', ' ')} grew from {before} to {now}")
        if s.get("xid"):
            out.append(f"GPU {s.get('gpu')}: Xid error(s) {', '.join(map(str, s['xid']))} (see the driver log)")
        self.last = {k: s.get(k) for k in self.COUNTERS}
        return out


class TelemetrySampler:
    """Samples every `interval_s` in a daemon thread and hands (sample, warnings) to `emit`; `latest`
    is the newest sample (the straggler report shows it beside a slow rank)."""

    def __init__(self, run_dir: Path, interval_s: float, emit, limits: Thresholds = Thresholds(),
                 gpu: GpuSensors | None = None):
        self.run_dir, self.interval_s, self.emit, self.gpu = Path(run_dir), interval_s, emit, gpu
        self.warnings = HealthWarnings(limits)
        self.latest: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hardy-telemetry", daemon=True)

    def sample_now(self) -> dict:
        sample = take_sample(self.run_dir, self.gpu)
        sample["time"] = time.time()
        self.latest = sample
        self.emit(sample, self.warnings.check(sample))
        return sample

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample_now()
            except Exception as e:  # noqa: BLE001 - telemetry must never take the run down
                log.warning("telemetry: sampling failed: %s", e)
            self._stop.wait(self.interval_s)

    def start(self) -> "TelemetrySampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
