"""Training configuration: one typed dataclass per component, loaded from TOML + `--set` overrides.

Each component receives only its own section. Everything is validated before any work starts;
the resolved config (after overrides and derived values) is written to the run directory and
into every checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hardy.errors import HardyError
from hardy.fault.inject import parse_faults
from hardy.model.config import PRESETS
from hardy.parallel.dims import WRAPS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPE_NAMES = ("fp32", "bf16", "fp16")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise HardyError(f"invalid config: {msg}")


@dataclass
class ModelSection:
    preset: str = "tiny"
    init_from: str = ""  # "" = from scratch; else smollm2-135m, a .gguf file or a model directory
    dropout: float = 0.0  # residual dropout while training (the model config's `dropout`)
    # a preset's first N blocks only (0 = all): a real model's shapes at a size one device holds, for
    # throughput measurements and checking the planner (the GPU check trains 8 of Llama 3.1 8B's 32)
    n_layers: int = 0

    def __post_init__(self):
        _check(self.preset in PRESETS, f"model.preset {self.preset!r} is not one of {', '.join(PRESETS)}")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1) (got {self.dropout})")
        _check(self.n_layers >= 0, f"model.n_layers must be >= 0 (got {self.n_layers})")
        _check(not (self.n_layers and self.init_from), "model.n_layers applies to a preset, not to model.init_from")


@dataclass
class DataSection:
    path: str = ""  # a prepared dataset directory (hardy data prepare)
    inputs: list[str] = field(default_factory=list)  # or raw text files / bundled corpora, prepared on start
    tokenizer: str = "bpe:8192"  # for `inputs`: smollm2 or bpe:VOCAB
    seq_len: int = 256
    val_fraction: float = 0.05

    def __post_init__(self):
        _check(bool(self.path) != bool(self.inputs), "set exactly one of data.path or data.inputs")
        _check(self.seq_len >= 2, f"data.seq_len must be >= 2 (got {self.seq_len})")
        _check(0 <= self.val_fraction < 1, f"data.val_fraction must be in [0, 1) (got {self.val_fraction})")


@dataclass
class TrainSection:
    steps: int = 200
    seed: int = 1234
    micro_batch: int = 8
    grad_accum: int = 1
    activation_checkpoint: str = "none"  # none | full | every:K | selective (op level: keep matmul outputs)
    compile: bool = False
    # Repeatable kernels, so a resumed run equals an uninterrupted one bit for bit (on the same hardware,
    # world size and software). On CUDA: a fixed cuBLAS workspace and cuDNN's deterministic algorithms,
    # and torch's deterministic variants (embedding backward, index ops); docs/gpu.md gives its cost.
    deterministic: bool = True
    peak_tflops: float = 0.0  # the peak MFU is reported against (the datasheet's); 0 = measure a matmul
    threads: int = 0  # 0 = leave torch's default (torchrun sets OMP_NUM_THREADS=1 per process)
    # CPU: hand freed memory back to the OS at once (glibc mmap for blocks >= 64 KiB). Peak RSS then
    # tracks live tensors (what `hardy plan` predicts) instead of growing with heap fragmentation
    # (FSDP2 on gloo: +100 MB per step), at a speed cost: steps took 1.5-2x as long here (BENCHMARKS.md).
    release_memory: bool = False

    def __post_init__(self):
        _check(self.steps >= 1, f"train.steps must be >= 1 (got {self.steps})")
        _check(self.micro_batch >= 1, f"train.micro_batch must be >= 1 (got {self.micro_batch})")
        _check(self.grad_accum >= 1, f"train.grad_accum must be >= 1 (got {self.grad_accum})")
        _check(self.threads >= 0, f"train.threads must be >= 0 (got {self.threads})")
        _check(self.peak_tflops >= 0, f"train.peak_tflops must be >= 0 (got {self.peak_tflops})")
        ac = self.activation_checkpoint
        ok = ac in ("none", "full", "selective") or (ac.startswith("every:") and ac[6:].isdigit() and int(ac[6:]) >= 1)
        _check(ok, f"train.activation_checkpoint must be none, full, selective or every:K (got {ac!r})")


@dataclass
class OptimSection:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off

    def __post_init__(self):
        _check(self.lr > 0, f"optim.lr must be > 0 (got {self.lr})")
        _check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1] (got {self.min_lr_ratio})")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        _check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)")
        _check(self.grad_clip >= 0, f"optim.grad_clip must be >= 0 (got {self.grad_clip})")


@dataclass
class ParallelSection:
    dp_replicate: int = -1  # -1: all processes not used by the other degrees
    dp_shard: int = 1
    tp: int = 1
    reshard_after_forward: bool = True  # FSDP2: True = full shard (ZeRO-3), False = shard-grad-op (ZeRO-2)
    cpu_offload: bool = False  # FSDP2: sharded parameters, gradients and optimizer states in host memory
    backend: str = "auto"  # auto | gloo | nccl
    # auto: FSDP2 when dp_shard > 1, DDP when only dp_replicate > 1; fsdp / ddp: that wrapper even at
    # degree 1 (FSDP2's mixed precision and CPU offload on one device; one process gets a one-rank group)
    wrap: str = "auto"

    def __post_init__(self):
        _check(self.backend in ("auto", "gloo", "nccl"), "parallel.backend must be auto, gloo or nccl")
        _check(self.wrap in WRAPS, f"parallel.wrap must be one of {', '.join(WRAPS)} (got {self.wrap!r})")


@dataclass
class PrecisionSection:
    dtype: str = "fp32"  # compute/parameter dtype in forward and backward
    reduce_dtype: str = "fp32"  # gradient reduction dtype
    loss_scale: float = 65536.0  # fp16 only: initial dynamic loss scale
    loss_scale_growth_interval: int = 200
    tf32: bool = True  # CUDA: fp32 matmuls on TF32 tensor cores (Ampere and newer); no effect on CPUs

    def __post_init__(self):
        _check(self.dtype in DTYPE_NAMES, f"precision.dtype must be one of {', '.join(DTYPE_NAMES)}")
        _check(self.reduce_dtype in DTYPE_NAMES, f"precision.reduce_dtype must be one of {', '.join(DTYPE_NAMES)}")
        _check(self.loss_scale > 0, "precision.loss_scale must be > 0")
        _check(self.loss_scale_growth_interval >= 1, "precision.loss_scale_growth_interval must be >= 1")


@dataclass
class CheckpointSection:
    interval: int | str = 0  # steps between checkpoints; 0 = only at the end; "auto" = Young/Daly optimum
    interval_seconds: float = 0.0  # or: every T seconds of training (0 = off)
    keep: int = 3
    resume: str = "auto"  # auto | never | a checkpoint directory
    at_end: bool = True
    async_save: bool = False  # overlap the write with training (DCP async_save)
    # every N steps each process's state in /dev/shm and a copy on the next node: a restart reads RAM (0 = off)
    memory_interval: int = 0
    device_mtbf_hours: float = 50700.0  # per device; job MTBF = this / world size (Llama 3 figure)

    def __post_init__(self):
        ok = self.interval == "auto" or (isinstance(self.interval, int) and self.interval >= 0)
        _check(ok, f"checkpoint.interval must be a number of steps >= 0 or \"auto\" (got {self.interval!r})")
        _check(self.interval_seconds >= 0, "checkpoint.interval_seconds must be >= 0")
        _check(self.keep >= 1, f"checkpoint.keep must be >= 1 (got {self.keep})")
        _check(self.memory_interval >= 0, f"checkpoint.memory_interval must be >= 0 (got {self.memory_interval})")
        _check(self.device_mtbf_hours > 0, "checkpoint.device_mtbf_hours must be > 0")


@dataclass
class FaultSection:
    skip_nonfinite: bool = True  # a NaN/Inf loss or gradient norm on any rank skips the step on all ranks
    spike_detection: bool = True  # loss above median + threshold x MAD of the window -> roll back
    spike_window: int = 50
    spike_threshold: float = 6.0
    spike_warmup: int = 50
    max_rollbacks: int = 3
    hang_timeout_s: float = 600.0  # no step completed for this long -> dump stacks, exit for a restart; 0 = off
    startup_timeout_s: float = 1800.0  # the same from process start to the first completed step
    # e.g. "kill@37,kill_in_ckpt@60,nan@50,spike@70,hang@80,corrupt_ckpt@60" (@rankR optional), "slow@rank1:2x@10-90"
    inject: str = ""
    random_kill_rate: float = 0.0  # probability that a step ends in SIGKILL (simulated failure-prone cluster)
    random_seed: int = 0
    # restart: a failure restarts every process from the newest checkpoint (torchrun). live: the
    # parallel.dp_replicate groups form a torchft quorum every step; a failed group is left out and
    # heals from a live peer while the others go on (hardy.fault.live)
    recovery: str = "restart"
    # live: the survivors compute a missing group's share, so the result is bitwise a fault-free run's
    exact: bool = False
    spares: int = 0  # live: extra replica groups, in sync, that take a failed group's share at once
    heartbeat_timeout_ms: int = 300  # live: a group silent this long (dead, or stopped) is out of the next quorum
    join_timeout_s: float = 30.0  # live: how long a quorum waits for a group still heartbeating but late (a save)
    live_timeout_s: float = 2.0  # live: a cross-group all-reduce waits this long for a peer (a hung group)
    quorum_timeout_s: float = 60.0  # live: the longest a step waits for its quorum

    def __post_init__(self):
        parse_faults(self.inject)
        _check(self.recovery in ("restart", "live"), f"fault.recovery must be restart or live (got {self.recovery!r})")
        _check(self.spares >= 0, "fault.spares must be >= 0")
        _check((not self.exact and not self.spares) or self.recovery == "live",
               "fault.exact and fault.spares need fault.recovery = live")
        _check(min(self.heartbeat_timeout_ms, self.live_timeout_s, self.quorum_timeout_s, self.join_timeout_s) > 0,
               "fault.heartbeat_timeout_ms, live_timeout_s, join_timeout_s and quorum_timeout_s must be > 0")
        _check(self.spike_window >= 3, "fault.spike_window must be >= 3")
        _check(self.spike_threshold > 0, "fault.spike_threshold must be > 0")
        _check(self.spike_warmup >= 0 and self.max_rollbacks >= 0, "fault.spike_warmup and max_rollbacks must be >= 0")
        _check(self.hang_timeout_s >= 0 and self.startup_timeout_s >= 0,
               "fault.hang_timeout_s and fault.startup_timeout_s must be >= 0")
        _check(0 <= self.random_kill_rate < 1, "fault.random_kill_rate must be in [0, 1)")


@dataclass
class HealthSection:
    telemetry_interval_s: float = 10.0  # host (psutil) and GPU (NVML) sensors sampled this often; 0 = off
    warn_gpu_temp_c: float = 85.0
    warn_cpu_temp_c: float = 95.0
    warn_swap_growth_mib: float = 256.0  # swap in use grown this much since the start
    warn_disk_free_gib: float = 5.0  # free space left in the run directory
    straggler_every: int = 50  # steps per straggler comparison across ranks; 0 = off (one process: off)
    straggler_factor: float = 1.5  # slower than this times the median of the other ranks: a straggler
    straggler_stop_after: int = 0  # act when one rank is a straggler this many windows in a row; 0 = never
    # stop: the job stops; evict (live recovery): the slow replica group leaves and the others go on
    straggler_action: str = "stop"

    def __post_init__(self):
        _check(self.telemetry_interval_s == 0 or self.telemetry_interval_s >= 0.1,
               "health.telemetry_interval_s must be 0 (off) or >= 0.1")
        _check(self.warn_swap_growth_mib >= 0 and self.warn_disk_free_gib >= 0,
               "health.warn_swap_growth_mib and warn_disk_free_gib must be >= 0")
        _check(self.straggler_every >= 0 and self.straggler_stop_after >= 0,
               "health.straggler_every and straggler_stop_after must be >= 0")
        _check(self.straggler_factor > 1, f"health.straggler_factor must be > 1 (got {self.straggler_factor})")
        _check(self.straggler_action in ("stop", "evict"), "health.straggler_action must be stop or evict")


@dataclass
class LogSection:
    every: int = 1
    jsonl: bool = True
    tensorboard: bool = False
    progress: bool = True
    sample_ids: bool = False  # each rank's sample indices per step in RUN_DIR/sample_ids_rank<R>.jsonl (audits)

    def __post_init__(self):
        _check(self.every >= 1, f"log.every must be >= 1 (got {self.every})")


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=lambda: DataSection(inputs=["tinyshakespeare"]))
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    fault: FaultSection = field(default_factory=FaultSection)
    health: HealthSection = field(default_factory=HealthSection)
    log: LogSection = field(default_factory=LogSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


SECTIONS = typing.get_type_hints(TrainConfig)


def _coerce(section: str, key: str, value, annotation):
    hints = typing.get_type_hints(annotation)
    want = hints[key]
    origin = typing.get_origin(want)
    where = f"{section}.{key}"
    if want is bool:
        if not isinstance(value, bool):
            raise HardyError(f"invalid config: {where} must be true or false (got {value!r})")
        return value
    if want is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise HardyError(f"invalid config: {where} must be an integer (got {value!r})")
        return value
    if want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HardyError(f"invalid config: {where} must be a number (got {value!r})")
        return float(value)
    if want is str:
        if not isinstance(value, str):
            raise HardyError(f"invalid config: {where} must be a string (got {value!r})")
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for option in typing.get_args(want):
            if isinstance(value, option) and not (option is int and isinstance(value, bool)):
                return value
        raise HardyError(f"invalid config: {where} has the wrong type (got {value!r})")
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise HardyError(f"invalid config: {where} must be a list of strings (got {value!r})")
        return value
    return value


def build_config(raw: dict) -> TrainConfig:
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise HardyError(f"invalid config: unknown section [{unknown[0]}] (known: {', '.join(SECTIONS)})")
    sections = {}
    for name, cls in SECTIONS.items():
        values = raw.get(name, {})
        if not isinstance(values, dict):
            raise HardyError(f"invalid config: [{name}] must be a table")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(values) - known)
        if bad:
            raise HardyError(f"invalid config: unknown key {name}.{bad[0]} (known: {', '.join(sorted(known))})")
        coerced = {k: _coerce(name, k, v, cls) for k, v in values.items()}
        if name == "data" and not coerced:
            sections[name] = TrainConfig().data
            continue
        sections[name] = cls(**coerced)
    return TrainConfig(**sections)


def parse_override(item: str) -> tuple[str, str, object]:
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise HardyError(f"--set expects section.key=value (got {item!r})")
    dotted, text = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # bare words are strings: --set model.preset=micro
    return section, key, value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise HardyError(f"config file not found: {path}")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise HardyError(f"{path}: malformed TOML ({e})") from None
        except UnicodeDecodeError:
            raise HardyError(f"{path}: config is not UTF-8 text") from None
    for item in overrides:
        section, key, value = parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise HardyError(f"invalid config: [{section}] must be a table")
        raw[section][key] = value
    return build_config(raw)


def config_from_dict(data: dict) -> TrainConfig:
    """Rebuild a resolved config (e.g. from a checkpoint's JSON)."""
    return build_config(data)
