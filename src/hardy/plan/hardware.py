"""Hardware entries for the planner: the editable catalogue (catalogue.toml) and probe profiles.

One `Hardware` describes one *device* — a GPU, or one CPU socket (one process per socket/NUMA
node, the way CPU servers run) — and the node it sits in. Efficiency factors (the achievable
fraction of peak FLOP/s, memory bandwidth and link bandwidth) come from one documented source or
measurement per entry and are the same for every workload: the planner never tunes them per case.
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from hardy.errors import HardyError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CATALOGUE = Path(__file__).with_name("catalogue.toml")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8")  # fp8: the linears of `plan train --fp8`


def interpolate_log(table: tuple[tuple[int, float], ...], x: float) -> float:
    """Linear interpolation in log(x) over (x, value) points, clamped to the measured range."""
    points = sorted(table)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x <= x1:
            return v0 + (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) * (v1 - v0)
    return points[-1][1]


@dataclass(frozen=True)
class Link:
    """A collective fabric as one device sees it: unidirectional bytes/s per device and per-hop latency."""

    name: str
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per collective hop
    efficiency: float = 0.8  # achievable fraction of `bandwidth` for large collectives


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "gpu" or "cpu" (a CPU entry's device is one socket)
    description: str
    peak_flops: dict[str, float]  # dense FLOP/s per dtype (fp32, bf16, fp16, int8 where known)
    memory_bytes: float  # per device
    memory_bandwidth: float  # bytes/s per device
    flops_efficiency: float  # achievable fraction of peak FLOP/s in a training layer's GEMMs
    bandwidth_efficiency: float  # achievable fraction of peak memory bandwidth (stream copy / decode)
    devices_per_node: int
    intra_node: Link  # NVLink / xGMI / UPI / shared memory
    inter_node: Link  # InfiniBand / Ethernet (per device share of the node's NICs)
    disk_write_bandwidth: float  # bytes/s per node, to checkpoint storage
    price_per_device_hour: float | None  # USD; None when unknown
    device_mtbf_hours: float | None = None  # None: the Llama 3 default (hardy.fault.policy)
    fast_bf16: bool = True  # False: bf16/fp16 matmul is emulated (AVX2 CPUs) and must not be planned
    cores: int | None = None  # CPU cores per device (CPU entries)
    # Host cost per operator: GPU kernel-launch latency; CPU eager dispatch (Python + ATen). A probe
    # profile measures it; catalogue default: 5 µs GPU launch, 8 µs CPU dispatch.
    op_overhead_s: float = 0.0
    # Memory a training process holds beyond its tensors (allocator pools, thread stacks, library
    # workspaces): measured by `hardy probe` for CPU hosts; 0 in the catalogue, whose GPU figures are
    # compared with allocated tensor memory.
    runtime_overhead_bytes: float = 0.0
    distributed_runtime_overhead_bytes: float = 0.0  # the same, per process of a multi-process job
    # Bytes/s of eager elementwise operators (norms, activations, residuals); None: the achievable
    # memory bandwidth (GPU kernels stream near it; a probe measures it, far lower on CPUs).
    elementwise_bandwidth: float | None = None
    # Bytes/s a batch-1 matrix-vector product reads weights at (decode), overall and by matrix width
    # (the reduction dimension); None / empty: the achievable bandwidth.
    decode_bandwidth: float | None = None
    decode_bandwidth_by_width: tuple[tuple[int, float], ...] = ()
    # Bytes/s hardy's fused int4/int8 decode kernels read quantized weights at (a probe measures it on
    # a DRAM-sized matrix; they run nearer the copy rate than an fp32 GEMV); None: `decode_rate`.
    quantized_decode_bandwidth: float | None = None
    # The same kernels' rate on a mixture of experts' active experts (small matrices, a few of many per
    # token, csrc/moe.cpp), measured by a probe; None: `decode_rate`'s.
    expert_decode_bandwidth: float | None = None
    quantized_decode_bandwidth_by_width: tuple[tuple[int, float], ...] = ()  # the kernels' rate by matrix width
    # Achieved fraction of the peak by model width (training GEMMs) and by head size (causal
    # attention forward + backward), measured by a probe; empty: `flops_efficiency` for both.
    gemm_efficiency_by_width: tuple[tuple[int, float], ...] = ()
    # the same for the inference forward's projections alone (prefill, re-ranking); empty: the above
    forward_gemm_efficiency_by_width: tuple[tuple[int, float], ...] = ()
    attention_efficiency_by_head_dim: tuple[tuple[int, float], ...] = ()
    sources: tuple[str, ...] = ()
    date: str = ""  # when the figures (prices above all) were last checked
    efficiency_source: str = ""
    # (field, source id) for each constant taken from a published run that `hardy plan validate` also
    # checks (hardy.plan.public_runs.SOURCES): those runs are reported apart and left out of its fit
    calibrated_on: tuple[tuple[str, str], ...] = ()
    tdp_w: float | None = None  # the part's rated board power
    power_limit_w: float | None = None  # the limit it is run at, where that is below the TDP
    best_gemm_efficiency: float | None = None  # the best-case matmul's fraction of peak (MAMF), where cited
    best_gemm_efficiency_fp8: float | None = None  # the same for fp8 GEMMs (of the fp8 peak), where cited
    # causal flash attention forward + backward as a fraction of peak, where a kernel benchmark is cited
    # (the kernel stock PyTorch SDPA runs on the part); None: the GEMM rate
    attention_efficiency: float | None = None

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise HardyError(f"hardware {self.name!r} has no peak FLOP/s for {dtype} "
                             f"(known: {', '.join(sorted(self.peak_flops))})")
        return self.peak_flops[dtype]

    @property
    def clock_fraction(self) -> float:
        """The sustained clock of a part run below its rated power, as a fraction of the rated clock.
        Dynamic power goes as f·V² and the voltage scales with the clock across the DVFS range, so the
        clock a power limit sustains goes as its cube root (a model, not a measurement: static power is
        neglected, and a GEMM-heavy step is taken to run at the limit). 1 at or above the TDP."""
        if not self.tdp_w or not self.power_limit_w or self.power_limit_w >= self.tdp_w:
            return 1.0
        return (self.power_limit_w / self.tdp_w) ** (1 / 3)

    def sustained_peak(self, dtype: str) -> float:
        """The datasheet peak at the clock the part sustains (MFU stays against the datasheet's)."""
        return self.peak(dtype) * self.clock_fraction

    def achievable_flops(self, dtype: str) -> float:
        return self.sustained_peak(dtype) * self.gemm_efficiency(dtype)

    def gemm_efficiency(self, dtype: str) -> float:
        """A training layer's GEMMs' fraction of the dtype's peak: fp8 reaches the in-layer share
        (flops_efficiency ÷ best_gemm_efficiency) of its own best-case matmul, where both are cited."""
        if dtype == "fp8" and self.best_gemm_efficiency_fp8 and self.best_gemm_efficiency:
            return self.flops_efficiency / self.best_gemm_efficiency * self.best_gemm_efficiency_fp8
        return self.flops_efficiency

    def achievable_bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency

    def elementwise_rate(self) -> float:
        return self.elementwise_bandwidth or self.achievable_bandwidth()

    def decode_rate(self, width: int | None = None, quantized: bool = False) -> float:
        """Weight-streaming rate of decode; with measurements by width, interpolated (in log width)
        at the model's hidden size, clamped to the measured range. `quantized`: int4/int8 weights
        through hardy's kernels, at their measured rate where a probe has it."""
        if quantized and width is not None and self.quantized_decode_bandwidth_by_width:
            return interpolate_log(self.quantized_decode_bandwidth_by_width, width)
        if quantized and self.quantized_decode_bandwidth:
            return self.quantized_decode_bandwidth
        if width is None or not self.decode_bandwidth_by_width:
            return self.decode_bandwidth or self.achievable_bandwidth()
        return interpolate_log(self.decode_bandwidth_by_width, width)

    def expert_rate(self, width: int | None = None, quantized: bool = False) -> float:
        """Weight-streaming rate of decode over a mixture of experts' active experts."""
        if quantized and self.expert_decode_bandwidth:
            return self.expert_decode_bandwidth
        return self.decode_rate(width, quantized)

    def gemm_rate(self, dtype: str, width: int | None = None, forward: bool = False) -> float:
        """FLOP/s of a layer's training GEMMs at a model width (measured by a probe; otherwise the
        entry's large-GEMM efficiency); `forward`: the inference forward's, where measured."""
        table = (forward and self.forward_gemm_efficiency_by_width) or self.gemm_efficiency_by_width
        if width is None or not table:
            return self.achievable_flops(dtype)
        return self.sustained_peak(dtype) * interpolate_log(table, width)

    def attention_rate(self, dtype: str, head_dim: int | None = None) -> float:
        """FLOP/s of causal attention forward + backward at a head size (measured by a probe: a CPU's
        flash kernel runs far below its GEMMs), else the entry's cited kernel figure, else the GEMM rate."""
        if head_dim is not None and self.attention_efficiency_by_head_dim:
            return self.sustained_peak(dtype) * interpolate_log(self.attention_efficiency_by_head_dim, head_dim)
        if self.attention_efficiency is not None and dtype in ("bf16", "fp16"):  # the flash kernels' dtypes
            return self.sustained_peak(dtype) * self.attention_efficiency
        return self.achievable_flops(dtype)

    def link(self, group_size: int) -> Link:
        """The fabric a collective over `group_size` devices runs on: inside a node when it fits."""
        return self.intra_node if group_size <= self.devices_per_node else self.inter_node

    def group_link(self, span: int, members_per_node: int = 1) -> Link:
        """The fabric of an all-gather, reduce-scatter or all-reduce whose group spans `span` consecutive
        devices with `members_per_node` of its members in each node. Across nodes, NCCL's rings enter and
        leave a node once per channel, one NIC each: a node's share crosses the network once and spreads
        over the intra-node link, so the members' NICs add up, to at most the intra-node link's rate."""
        if span <= self.devices_per_node:
            return self.intra_node
        members = max(1, min(members_per_node, self.devices_per_node))
        intra, inter = self.intra_node, self.inter_node
        if members == 1:
            return inter
        rate = min(intra.bandwidth * intra.efficiency, members * inter.bandwidth * inter.efficiency)
        return Link(f"{inter.name}, {members} NICs per node", rate, inter.latency, 1.0)

    def split(self, processes: int, share: float | None = None, name: str | None = None) -> "Hardware":
        """What each of `processes` processes on one device gets (a CPU host running several
        training processes): memory divides; compute and bandwidth scale by `share` (default an equal
        split; a process pinned to some of the cores gets their share); links stay."""
        share = 1.0 / processes if share is None else share
        if processes <= 1 and share == 1.0 and name is None:
            return self

        def scaled(rate):
            return None if rate is None else rate * share

        return dataclasses.replace(
            self, name=name or f"{self.name}/{processes}", peak_flops={k: v * share for k, v in self.peak_flops.items()},
            memory_bytes=self.memory_bytes / processes, memory_bandwidth=self.memory_bandwidth * share,
            cores=None if self.cores is None else max(1, round(self.cores * share)), devices_per_node=processes,
            elementwise_bandwidth=scaled(self.elementwise_bandwidth), decode_bandwidth=scaled(self.decode_bandwidth),
            quantized_decode_bandwidth=scaled(self.quantized_decode_bandwidth),
            expert_decode_bandwidth=scaled(self.expert_decode_bandwidth),
            quantized_decode_bandwidth_by_width=tuple((w, r * share)
                                                      for w, r in self.quantized_decode_bandwidth_by_width),
            decode_bandwidth_by_width=tuple((w, r * share) for w, r in self.decode_bandwidth_by_width))


def _link(data: dict, where: str, field: str) -> Link:
    """One [NAME.intra_node] / [NAME.inter_node] table; `field` names it in errors."""
    try:
        return Link(name=str(data["name"]), bandwidth=_positive(data["bandwidth_gbs"], f"{field}.bandwidth_gbs") * 1e9,
                    latency=float(data["latency_us"]) * 1e-6,
                    efficiency=_fraction(data.get("efficiency", 0.8), f"{field}.efficiency"))
    except (KeyError, TypeError, ValueError) as e:
        raise HardyError(f"{where}: bad link entry ({e})") from None


def hardware_from_dict(name: str, data: dict, where: str = "catalogue") -> Hardware:
    """One catalogue table → Hardware (units in the file: TFLOP/s, GB, GB/s, µs, USD/h)."""
    try:
        peak = {k: _positive(v, f"peak_tflops.{k}") * 1e12 for k, v in data["peak_tflops"].items()}
        unknown = sorted(set(peak) - set(PRECISIONS))
        if unknown:
            raise ValueError(f"unknown dtype(s) {', '.join(unknown)}")
        return Hardware(
            name=name, kind=str(data["kind"]), description=str(data.get("description", "")), peak_flops=peak,
            memory_bytes=_positive(data["memory_gb"], "memory_gb") * 1e9,
            memory_bandwidth=_positive(data["bandwidth_gbs"], "bandwidth_gbs") * 1e9,
            flops_efficiency=_fraction(data["flops_efficiency"], "flops_efficiency"),
            bandwidth_efficiency=_fraction(data["bandwidth_efficiency"], "bandwidth_efficiency"),
            devices_per_node=_count(data["devices_per_node"], "devices_per_node"),
            intra_node=_link(data["intra_node"], f"{where} [{name}]", "intra_node"),
            inter_node=_link(data["inter_node"], f"{where} [{name}]", "inter_node"),
            disk_write_bandwidth=float(data.get("disk_write_gbs", 2.0)) * 1e9,
            price_per_device_hour=None if data.get("price_per_device_hour") is None
            else float(data["price_per_device_hour"]),
            device_mtbf_hours=None if data.get("device_mtbf_hours") is None else float(data["device_mtbf_hours"]),
            fast_bf16=bool(data.get("fast_bf16", True)), cores=data.get("cores"),
            op_overhead_s=float(data.get("op_overhead_us", 5.0 if data["kind"] == "gpu" else 8.0)) * 1e-6,
            sources=tuple(data.get("sources", ())), date=str(data.get("date", "")),
            efficiency_source=str(data.get("efficiency_source", "")),
            calibrated_on=tuple((str(k), str(v)) for k, v in data.get("calibrated_on", {}).items()),
            tdp_w=None if data.get("tdp_w") is None else float(data["tdp_w"]),
            power_limit_w=None if data.get("power_limit_w") is None else float(data["power_limit_w"]),
            best_gemm_efficiency=_fraction(data.get("best_gemm_efficiency"), "best_gemm_efficiency"),
            attention_efficiency=_fraction(data.get("attention_efficiency"), "attention_efficiency"),
            best_gemm_efficiency_fp8=_fraction(data.get("best_gemm_efficiency_fp8"), "best_gemm_efficiency_fp8"))
    except HardyError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise HardyError(f"{where} [{name}]: bad or missing field ({e})") from None


def _is_number(value) -> bool:
    """An int or float as TOML and JSON give them (not a string, not true/false)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value, field: str, what: str) -> float:
    """A catalogue number, or a ValueError naming the field."""
    if not _is_number(value):
        raise ValueError(f"{field} must be {what}, got {value!r}")
    return float(value)


def _fraction(value, field: str) -> float | None:
    """An efficiency factor: a fraction of a peak, in (0, 1] (NaN is not). None stays None (not given)."""
    if value is None:
        return None
    value = _number(value, field, "a number in (0, 1]")
    if not 0 < value <= 1:
        raise ValueError(f"{field} must be in (0, 1], got {value}")
    return value


def _positive(value, field: str) -> float:
    """A peak rate or a size: a finite number above 0."""
    value = _number(value, field, "a positive number")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{field} must be a positive number, got {value}")
    return value


def _count(value, field: str) -> int:
    """A whole number of devices, at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a whole number >= 1, got {value!r}")
    return value


def load_catalogue(path: Path | None = None) -> dict[str, Hardware]:
    path = Path(path) if path is not None else CATALOGUE
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise HardyError(f"cannot read hardware catalogue {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise HardyError(f"hardware catalogue {path} is not valid TOML: {e}") from None
    entries = data.get("hardware")
    if not isinstance(entries, dict) or not entries:
        raise HardyError(f"hardware catalogue {path} has no [hardware.NAME] tables")
    derive_layer_gemm_efficiency(entries, data.get("layer_gemm"), str(path))
    return {name: hardware_from_dict(name, entry, str(path)) for name, entry in entries.items()}


def derive_layer_gemm_efficiency(entries: dict, layer_gemm: dict | None, where: str) -> None:
    """Fill in `flops_efficiency` for entries that cite only a best-case matmul figure: GEMMs inside
    training layers reach the share of the best case that [layer_gemm] `reference`'s entry measured
    (both figures given there), and the constant then comes from the reference's source."""
    derived = [name for name, e in entries.items() if isinstance(e, dict) and "flops_efficiency" not in e
               and "best_gemm_efficiency" in e]
    if not derived:
        return
    ref_name = (layer_gemm or {}).get("reference")
    ref = entries.get(ref_name) if isinstance(ref_name, str) else None
    if not isinstance(ref, dict) or "flops_efficiency" not in ref or "best_gemm_efficiency" not in ref:
        raise HardyError(f"{where}: [hardware.{derived[0]}] gives best_gemm_efficiency without flops_efficiency, "
                         "and [layer_gemm] reference names no entry with both")
    name = ref_name
    try:
        share = (_fraction(ref["flops_efficiency"], "flops_efficiency")
                 / _fraction(ref["best_gemm_efficiency"], "best_gemm_efficiency"))
        origin = (ref.get("calibrated_on") or {}).get("flops_efficiency")
        for name in derived:
            entry = entries[name]
            entry["flops_efficiency"] = _fraction(entry["best_gemm_efficiency"], "best_gemm_efficiency") * share
            if origin:
                entry["calibrated_on"] = {**entry.get("calibrated_on", {}), "flops_efficiency": origin}
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise HardyError(f"{where} [{name}]: bad GEMM efficiency field ({e})") from None


def get_hardware(name: str, catalogue: Path | None = None) -> Hardware:
    """A catalogue entry by name, or `probe:FILE` for a profile written by `hardy probe`."""
    if name.startswith("probe:"):
        return hardware_from_profile_file(Path(name[len("probe:"):]))
    entries = load_catalogue(catalogue)
    if name not in entries:
        raise HardyError(f"unknown hardware {name!r} (catalogue: {', '.join(entries)}; or probe:FILE)")
    return entries[name]


def describe_hardware(hw: Hardware) -> list[tuple[str, str]]:
    """Readable (label, value) rows for listings such as `hardy plan hardware`."""
    def link(k: Link) -> str:
        return (f"{k.name}: {k.bandwidth / 1e9:,.1f} GB/s per device, {k.latency * 1e6:.1f} µs, "
                f"efficiency {k.efficiency:.2f}")

    def tflops(v: float) -> str:
        return f"{v / 1e12:,.1f}" if v >= 1e12 else f"{v / 1e12:.3g}"

    unit = "socket" if hw.kind == "cpu" else "device"
    order = sorted(hw.peak_flops, key=lambda d: PRECISIONS.index(d) if d in PRECISIONS else len(PRECISIONS))
    peaks = ", ".join(f"{d} {tflops(hw.peak_flops[d])}" for d in order)
    rows = [("kind", hw.kind + (f", {hw.cores} cores per {unit}" if hw.cores else "")),
            ("description", hw.description),
            ("peak TFLOP/s (dense)", peaks + ("" if hw.fast_bf16 else "  (bf16/fp16 emulated: slow)")),
            ("memory", f"{hw.memory_bytes / 1e9:,.1f} GB per {unit}"),
            ("memory bandwidth", f"{hw.memory_bandwidth / 1e9:,.1f} GB/s per {unit}"),
            ("efficiency", f"GEMM {hw.flops_efficiency:.2f}" + (
                f" (best-case matmul {hw.best_gemm_efficiency:.2f})" if hw.best_gemm_efficiency else "")
             + (f", fp8 GEMM {hw.gemm_efficiency('fp8'):.2f} (best-case {hw.best_gemm_efficiency_fp8:.2f})"
                if hw.best_gemm_efficiency_fp8 else "")
             + (f", flash attention {hw.attention_efficiency:.2f}" if hw.attention_efficiency else "")
             + f", memory {hw.bandwidth_efficiency:.2f}"),
            ("power", "unknown" if not hw.tdp_w else f"{hw.tdp_w:,.0f} W rated" + (
                f", run at {hw.power_limit_w:,.0f} W: sustained clock {hw.clock_fraction:.3f} of rated (modelled)"
                if hw.clock_fraction < 1 else "")),
            (f"{unit}s per node", str(hw.devices_per_node)),
            ("intra-node link", link(hw.intra_node)),
            ("inter-node link", link(hw.inter_node)),
            ("checkpoint disk", f"{hw.disk_write_bandwidth / 1e9:,.1f} GB/s per node"),
            ("price", "unknown" if hw.price_per_device_hour is None
             else f"USD {hw.price_per_device_hour:,.2f} per {unit}-hour (approximate)"),
            ("MTBF", "Llama 3 default" if hw.device_mtbf_hours is None else f"{hw.device_mtbf_hours:,.0f} h per {unit}"),
            ("efficiency source", hw.efficiency_source or "not given")]
    rows += [("source", s) for s in hw.sources]
    rows.append(("date", hw.date or "not given"))
    return rows


# A `hardy probe` profile as a planner `Hardware` entry (`--hardware probe:FILE`).
#
# The probed numbers are achieved ones (best measured matmul, measured copy bandwidth, measured
# all-reduce), so every efficiency factor is 1.0: applying a datasheet efficiency on top would count
# the loss twice.
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
        if not _is_number(value) or not math.isfinite(value) or (positive and value <= 0):
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
    if profile["matmul"].get("fast_fp8"):  # measured, and not emulated: `plan train --fp8` may use it
        peak["fp8"] = _field(profile, "matmul.fp8.best_flops", where)
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
        expert_decode_bandwidth=(profile.get("quant_gemv") or {}).get("expert_bandwidth"),
        quantized_decode_bandwidth_by_width=_table(profile, "quant_gemv", "bandwidth_by_width"),
        # a real layer's GEMMs (all its shapes, median rate) where the profile has them; older profiles
        # have only the one-shape benchmark of a linear layer
        gemm_efficiency_by_width=(_table(profile, "layer_gemm", "efficiency_by_width")
                                  or _table(profile, "training_gemm", "efficiency_by_width")),
        forward_gemm_efficiency_by_width=_table(profile, "layer_gemm_forward", "efficiency_by_width"),
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
    return hardware_from_profile(read_profile(path), where=f"probe profile {path}", name=f"probe:{path}")


def read_profile(path: Path) -> dict:
    """A `hardy probe` profile's JSON, or a one-line error naming the file."""
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
    return profile
