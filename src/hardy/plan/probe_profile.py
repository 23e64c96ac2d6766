"""A `hardy probe` profile as a planner `Hardware` entry (`--hardware probe:FILE`).

The probed numbers are achieved ones (best measured matmul, measured copy bandwidth, measured
all-reduce), so every efficiency factor is 1.0: applying a datasheet efficiency on top would count
the loss twice.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from hardy.errors import HardyError
from hardy.plan.hardware import Hardware, Link

SCHEMA = "hardy.probe/1"
_MISSING = object()


def _field(profile: dict, dotted: str, where: str, kind=float, positive: bool = True):
    """profile["a"]["b"] for "a.b", checked; any problem is one HardyError line naming the field."""
    value = profile
    for key in dotted.split("."):
        value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            raise HardyError(f"{where}: missing field {dotted!r}; rerun hardy probe")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (positive and value <= 0):
            raise HardyError(f"{where}: field {dotted!r} must be a positive number, not {value!r}")
        return float(value)
    if not isinstance(value, kind):
        raise HardyError(f"{where}: field {dotted!r} has the wrong type ({type(value).__name__})")
    return value


def _table(profile: dict, section: str, key: str) -> tuple[tuple[int, float], ...]:
    """A {size: value} table of an optional section (older profiles lack it: empty)."""
    return tuple(sorted((int(k), float(v)) for k, v in ((profile.get(section) or {}).get(key) or {}).items()))


def hardware_from_profile(profile: dict, where: str = "profile", name: str | None = None) -> Hardware:
    if not isinstance(profile, dict):
        raise HardyError(f"{where}: not a hardy probe profile (expected a JSON object)")
    schema = profile.get("schema")
    if schema != SCHEMA:
        raise HardyError(f"{where}: not a hardy probe profile (schema {schema!r}, expected {SCHEMA!r})")
    created = _field(profile, "created", where, str)
    dtypes = _field(profile, "matmul.dtypes", where, dict)
    peak = {}
    for dtype in ("fp32", "bf16", "fp16"):
        if dtype in dtypes or dtype == "fp32":  # fp32 is always measured; the others normally are
            peak[dtype] = _field(profile, f"matmul.dtypes.{dtype}.best_flops", where)
    allreduce = _field(profile, "allreduce", where, dict)
    if "error" in allreduce:
        raise HardyError(f"{where}: the all-reduce was not measured ({allreduce['error']}); rerun hardy probe")
    bus = _field(profile, "allreduce.bus_bandwidth", where)
    latency = _field(profile, "allreduce.latency_s", where)
    backend = str(allreduce.get("backend", "?"))
    cores = int(_field(profile, "cpu.physical_cores", where))
    gpu = profile.get("gpu")
    cpu_model = str(profile.get("cpu", {}).get("model", "cpu"))
    host = str(profile.get("hostname", "?"))
    if gpu:  # the GPU is the device; its host is the node
        kind = "gpu"
        memory = _field(profile, "gpu.memory_bytes", where)
        per_node = int(_field(profile, "gpu.count", where))
        description = f"{per_node} x {gpu.get('name', 'GPU')} on {host} (measured by hardy probe)"
        device_cores = None
    else:  # the whole probed machine is one device: one process uses every core
        kind = "cpu"
        memory = _field(profile, "cpu.memory_total_bytes", where)
        per_node = 1
        description = f"{cpu_model}, {cores} cores, on {host} (measured by hardy probe)"
        device_cores = cores
    intra = Link(name=f"measured {backend} all-reduce between 2 local processes", bandwidth=bus,
                 latency=latency, efficiency=1.0)
    inter = Link(name=f"copy of the measured local {backend} all-reduce (no inter-node measurement)",
                 bandwidth=bus, latency=latency, efficiency=1.0)
    return Hardware(
        name=name or f"probe:{host}", kind=kind, description=description, peak_flops=peak,
        memory_bytes=memory, memory_bandwidth=_field(profile, "memory.bandwidth", where),
        flops_efficiency=float((profile.get("training_gemm") or {}).get("efficiency", 1.0)),
        bandwidth_efficiency=1.0, devices_per_node=max(1, per_node),
        elementwise_bandwidth=(profile.get("elementwise") or {}).get("bandwidth"),
        decode_bandwidth=(profile.get("gemv") or {}).get("bandwidth"),
        decode_bandwidth_by_width=_table(profile, "gemv", "bandwidth_by_width"),
        quantized_decode_bandwidth=(profile.get("quant_gemv") or {}).get("bandwidth"),
        # a real layer's GEMMs (all its shapes, median rate) where the profile has them; older profiles
        # have only the one-shape benchmark of a linear layer
        gemm_efficiency_by_width=(_table(profile, "layer_gemm", "efficiency_by_width")
                                  or _table(profile, "training_gemm", "efficiency_by_width")),
        attention_efficiency_by_head_dim=_table(profile, "attention", "efficiency_by_head_dim"),
        intra_node=intra, inter_node=inter,
        disk_write_bandwidth=_field(profile, "disk.write_bandwidth", where), price_per_device_hour=None,
        fast_bf16=bool(_field(profile, "matmul.fast_bf16", where, bool)), cores=device_cores,
        op_overhead_s=_field(profile, "dispatch.op_overhead_s", where),
        runtime_overhead_bytes=float((profile.get("training_runtime") or {}).get("runtime_overhead_bytes", 0.0)),
        distributed_runtime_overhead_bytes=float((profile.get("training_runtime") or {}).get(
            "distributed_runtime_overhead_bytes", (profile.get("training_runtime") or {}).get(
                "runtime_overhead_bytes", 0.0))),
        sources=(f"hardy probe {created}",), date=created[:10],
        efficiency_source="measured by hardy probe: peaks are the best square-matmul FLOP/s and the GEMM "
                          "efficiency is what a linear layer's three training GEMMs achieve at layer shapes; "
                          "bandwidth is the achieved copy rate (elementwise operators: their own measured rate), "
                          "links the achieved all-reduce")


def hardware_from_profile_file(path: Path) -> Hardware:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise HardyError(f"cannot read probe profile {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise HardyError(f"probe profile {path} is not JSON (binary data)") from None
    try:
        profile = json.loads(text)
    except json.JSONDecodeError as e:
        raise HardyError(f"probe profile {path} is not JSON ({e.msg} at line {e.lineno})") from None
    return hardware_from_profile(profile, where=f"probe profile {path}", name=f"probe:{path}")
