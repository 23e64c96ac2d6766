"""`hardy plan train`: memory per device, step time, MFU, time and cost to train, and what
failures cost (Young/Daly interval, goodput) for one parallel configuration — or a search."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from hardy.errors import HardyError
from hardy.fault.policy import DEFAULT_DEVICE_MTBF_HOURS, daly_interval, expected_goodput
from hardy.parallel.dims import ParallelDims
from hardy.plan.arch import Arch
from hardy.plan.hardware import Hardware
from hardy.plan.memory import (ACT_BYTES, LOSSES, STATE_BYTES, ActivationSetup, gathered_weight_bytes,
                               layer_activation_bytes, model_state_bytes, output_activation_bytes, state_bytes)
from hardy.plan.timing import StepSetup, StepTime, compute_dtype, step_time

GiB = 2 ** 30


@dataclass(frozen=True)
class TrainJob:
    arch: Arch
    hw: Hardware
    devices: int
    seq: int
    global_batch_tokens: int
    tokens: float = 0.0  # total training tokens (0: report per-step figures only)
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # default: devices ÷ (tp·pp)
    zero: int = 0  # 0 DDP, 1/2 ZeRO, 3 ZeRO-3 / FSDP full shard
    dp_replicate: int = 1  # HSDP: FSDP (zero 3) within groups of dp / dp_replicate, replicated across them
    cp: int = 1  # context parallelism: each sequence split over cp ranks (ring attention)
    fp8: str = "none"  # none | tensorwise | rowwise: the blocks' linears in fp8 (torchao float8 training)
    master_weights: bool = True  # False: weights, gradients and AdamW states in the 16-bit precision
    # gradients' data-parallel reduction: fp32 is FSDP2's in torchtitan and hardy, Composer's DEFAULT and
    # Megatron's; bf16 halves the bytes (FSDP2's reduce_dtype=None with bf16 parameters)
    reduce_dtype: str = "fp32"
    ac: str = "none"  # none | selective | full | every:K
    micro_batch: int = 1
    offload: str = "none"  # none | optimizer | params
    precision: str = "bf16"
    sequence_parallel: bool = False
    # TP's collectives cut into chunks that overlap the GEMMs they feed (torchtitan's async TP, inductor's
    # micro-pipeline TP pass): it needs sequence parallelism
    async_tp: bool = False
    compile: bool = False  # torch.compile per block (torchtitan's): the block's elementwise work fused
    loss: str | None = None  # Llama: "chunked" (hardy's fused loss, the default), "full" (fp32 logits), "compiled"
    fp8_all_gather: bool = False  # FSDP gathers the fp8 linears' weights in fp8 (needs --fp8 tensorwise, --zero 3)
    sp_style: str = "megatron"  # megatron | dtensor: what sequence parallelism keeps for the backward
    schedule: str = "1f1b"  # 1f1b | interleaved | zb-h1
    virtual_stages: int = 1
    # reliability
    device_mtbf_hours: float | None = None
    restart_s: float = 300.0  # detect + restart + reload; measured by the fault benchmark on this machine
    checkpoint_bandwidth: float | None = None  # bytes/s per node (default: the hardware's disk)
    optimizer_foreach: bool | None = None  # AdamW's multi-tensor path (default: on GPUs)
    # hardy's trainer frees gradients after each step (zero_grad(set_to_none=True)); Megatron and
    # DeepSpeed keep a persistent gradient buffer
    persistent_grads: bool = True


@dataclass
class TrainPlan:
    job: TrainJob
    dims: ParallelDims
    micro_batches: int
    memory: dict[str, float]  # per device, bytes
    host_memory: float
    params_local: float
    step: StepTime
    flops_per_token: float
    model_flops_per_step: float
    reliability: dict[str, float]
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The configuration in one short line (search results, plots)."""
        j = self.job
        hsdp = f" hsdp{j.dp_replicate}x{self.dims.dp // j.dp_replicate}" if j.dp_replicate > 1 else ""
        cp = f" cp{j.cp}" if j.cp > 1 else ""
        return f"tp{j.tp} pp{j.pp} dp{self.dims.dp}{hsdp}{cp} z{j.zero} {j.ac} mb{j.micro_batch}"

    @property
    def peak_memory(self) -> float:
        return self.memory["peak"]

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.job.hw.memory_bytes

    @property
    def step_s(self) -> float:
        return self.step.total_s

    @property
    def tokens_per_s(self) -> float:
        return self.job.global_batch_tokens / self.step_s

    @property
    def mfu(self) -> float:
        hw, dtype = self.job.hw, compute_dtype(self.job.hw, self.job.precision)
        return self.model_flops_per_step / (self.step_s * hw.peak(dtype) * self.job.devices)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilization: model FLOPs plus what recomputation adds, in the same accounting
        (so HFU = MFU without recompute, and HFU >= MFU always)."""
        hw, dtype = self.job.hw, compute_dtype(self.job.hw, self.job.precision)
        recompute, fraction = parse_ac(self.job.ac)
        extra = self.job.arch.recompute_flops_per_token(self.job.seq, recompute, fraction) * self.job.global_batch_tokens
        return (self.model_flops_per_step + extra) / (self.step_s * hw.peak(dtype) * self.job.devices)

    @property
    def train_time_s(self) -> float:
        return self.job.tokens / self.tokens_per_s if self.job.tokens else 0.0

    @property
    def cost(self) -> float | None:
        price = self.job.hw.price_per_device_hour
        if price is None or not self.job.tokens:
            return None
        return price * self.job.devices * self.effective_time_s / 3600

    @property
    def effective_time_s(self) -> float:
        g = self.reliability["goodput"]
        return self.train_time_s / g if g > 0 else math.inf

    def to_dict(self) -> dict:
        return {"model": self.job.arch.name, "hardware": self.job.hw.name, "devices": self.job.devices,
                "parallel": {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "zero": self.job.zero,
                             "dp_replicate": self.job.dp_replicate, "dp_shard": self.dims.dp // self.job.dp_replicate,
                             "cp": self.job.cp, "fp8": self.job.fp8, "fp8_all_gather": self.job.fp8_all_gather,
                             "ac": self.job.ac, "micro_batch": self.job.micro_batch,
                             "micro_batches": self.micro_batches, "offload": self.job.offload,
                             "precision": self.job.precision, "master_weights": self.job.master_weights,
                             "reduce_dtype": self.job.reduce_dtype,
                             "sequence_parallel": self.job.sequence_parallel, "sp_style": self.job.sp_style,
                             "async_tp": self.job.async_tp,
                             "compile": self.job.compile, "loss": loss_kind(self.job),
                             "schedule": self.job.schedule, "virtual_stages": self.job.virtual_stages},
                "memory_bytes": self.memory, "host_memory_bytes": self.host_memory,
                "device_memory_bytes": self.job.hw.memory_bytes,
                "fits": self.fits, "params_per_device": self.params_local,
                "step_time_s": self.step.__dict__, "tokens_per_s": self.tokens_per_s,
                "flops_per_token": self.flops_per_token, "mfu": self.mfu, "hfu": self.hfu,
                "train_time_s": self.train_time_s, "effective_time_s": self.effective_time_s,
                "cost_usd": self.cost, "reliability": self.reliability, "notes": self.notes}


def parse_ac(ac: str) -> tuple[str, float]:
    """--ac → (recompute mode, fraction of layers recomputed)."""
    if ac in ("none", "selective", "full"):
        return ac, 1.0 if ac != "none" else 0.0
    if ac == "selective-op":  # torchtitan's op-level policy: every second matmul's output saved
        return "selective_op", 1.0
    if ac.startswith("every:"):
        try:
            k = int(ac.split(":", 1)[1])
        except ValueError:
            k = 0
        if k >= 1:
            return "full", 1.0 / k
    raise HardyError(f"--ac must be none, selective, selective-op, full or every:K (got {ac!r})")


class Stages(NamedTuple):
    """A quantity on the first and on the last pipeline stage (the same stage when pp = 1)."""
    first: float
    last: float


def stage_params(arch: Arch, pp: int) -> Stages:
    """Parameters of the first and the last pipeline stage (embeddings first, head last; a tied
    embedding is kept on both ends when there is more than one stage, as Megatron does)."""
    per_stage_layers = -(-arch.n_layers // pp)
    body = per_stage_layers * arch.params_per_layer
    if pp == 1:
        return Stages(arch.params_total, arch.params_total)
    head = arch.params_head + (arch.vocab_size * arch.dim if arch.tie_embeddings else 0)
    return Stages(body + arch.params_embedding, body + head)


@dataclass(frozen=True)
class Layout:
    """How a job's devices and batch divide: data-parallel degree, the ranks states shard over (the
    data-parallel ranks of a sharding group, all of dp but under HSDP, times the context-parallel ones),
    micro-batches per step and replica, and the recompute mode."""
    dp: int
    shard_dp: int
    dims: ParallelDims
    micro_batches: int
    recompute: str
    recompute_fraction: float
    virtual_stages: int


def check_job(job: TrainJob) -> Layout:
    """The job's layout, or a one-line error naming what cannot be."""
    arch, hw = job.arch, job.hw
    if job.precision not in STATE_BYTES:
        raise HardyError(f"precision must be fp32, bf16 or fp16 (got {job.precision!r})")
    if job.precision != "fp32" and not hw.fast_bf16:
        raise HardyError(f"{hw.name} has no fast {job.precision} matmul (emulated, ~100x slower): plan fp32")
    if job.precision not in hw.peak_flops:
        raise HardyError(f"{hw.name} has no {job.precision} arithmetic in the catalogue "
                         f"(has {', '.join(sorted(hw.peak_flops))}): choose another --precision")
    if not job.master_weights and job.precision == "fp32":
        raise HardyError("--no-master-weights is for 16-bit training (--precision bf16 or fp16): fp32 weights "
                         "are their own master copy")
    if job.reduce_dtype not in ("fp32", "bf16"):
        raise HardyError(f"--reduce-dtype must be fp32 or bf16 (got {job.reduce_dtype!r})")
    if job.reduce_dtype == "bf16" and job.precision != "bf16":
        raise HardyError(f"--reduce-dtype bf16 is for --precision bf16 (got {job.precision}, whose gradients the "
                         "planner reduces in fp32)")
    if job.fp8 not in ("none", "tensorwise", "rowwise"):
        raise HardyError(f"--fp8 must be none, tensorwise or rowwise (got {job.fp8!r})")
    if job.fp8 != "none" and job.precision != "bf16":
        raise HardyError(f"--fp8 runs the linears in fp8 inside a bf16 model: it needs --precision bf16, not "
                         f"{job.precision}")
    if job.fp8 != "none" and "fp8" not in hw.peak_flops:
        raise HardyError(f"{hw.name} has no fp8 arithmetic in the catalogue (has {', '.join(sorted(hw.peak_flops))})")
    if job.sp_style not in ("megatron", "dtensor"):
        raise HardyError(f"--sp-style must be megatron or dtensor (got {job.sp_style!r})")
    if job.sp_style == "dtensor" and not job.sequence_parallel:
        raise HardyError("--sp-style dtensor says what sequence parallelism keeps: it needs --sp")
    if job.fp8_all_gather and (job.fp8 != "tensorwise" or job.zero != 3):
        raise HardyError("--fp8-all-gather gathers FSDP's weight shards in fp8 (torchao's float8 all-gather, "
                         f"tensorwise scaling only): it needs --fp8 tensorwise and --zero 3 (got --fp8 {job.fp8}, "
                         f"--zero {job.zero})")
    if job.async_tp and (job.tp < 2 or not job.sequence_parallel):
        raise HardyError("--async-tp overlaps sequence parallelism's all-gathers and reduce-scatters with their GEMMs: "
                         f"it needs --tp 2 or more and --sp (got --tp {job.tp}"
                         + (", --sp)" if job.sequence_parallel else ", no --sp)"))
    if job.compile and arch.family != "llama":
        raise HardyError(f"--compile is modelled for Llama-family models (the fused traffic is counted on hardy's "
                         f"compiled Llama block); {arch.name} is a {arch.family} model")
    if job.loss not in (None, *LOSSES):
        raise HardyError(f"--loss must be {', '.join(LOSSES)} (got {job.loss!r})")
    if job.loss in ("chunked", "compiled") and arch.family != "llama":
        raise HardyError(f"--loss {job.loss} is modelled for Llama-family models; {arch.name} is a "
                         f"{arch.family} model, whose loss keeps its fp32 logits (Megatron's: --loss full)")
    if job.schedule not in ("1f1b", "interleaved", "zb-h1"):
        raise HardyError(f"schedule must be 1f1b, interleaved or zb-h1 (got {job.schedule!r})")
    v = job.virtual_stages if job.schedule == "interleaved" else 1
    if v < 1:
        raise HardyError(f"virtual stages must be >= 1 (got {v})")
    if job.cp < 1:
        raise HardyError(f"--cp must be >= 1 (got {job.cp})")
    if job.cp > 1 and not arch.flash_attention:
        raise HardyError(f"context parallelism (ring attention) needs flash attention; {arch.name} has none")
    if job.seq % (2 * job.cp):
        raise HardyError(f"--seq {job.seq} does not split into 2 x cp = {2 * job.cp} equal chunks (the "
                         "load-balanced causal ring attention)")
    model_parallel = job.tp * job.pp * job.cp
    if job.dp is None and job.devices % model_parallel:
        what = "tp × pp × cp" if job.cp > 1 else "tp × pp"
        raise HardyError(f"{what} = {model_parallel} does not divide {job.devices} devices")
    dp = job.dp if job.dp is not None else job.devices // model_parallel
    if job.dp_replicate < 1 or dp % job.dp_replicate:
        raise HardyError(f"--dp-replicate {job.dp_replicate} must divide the data-parallel degree {dp}")
    if job.dp_replicate > 1 and job.zero != 3:
        raise HardyError(f"HSDP (--dp-replicate {job.dp_replicate}) shards within each replica group: it needs "
                         f"--zero 3, not {job.zero}")
    shard_dp = dp // job.dp_replicate * job.cp
    dims = ParallelDims.build(job.devices // job.cp, dp_replicate=dp if job.zero == 0 else job.dp_replicate,
                              dp_shard=1 if job.zero == 0 else dp // job.dp_replicate, tp=job.tp, pp=job.pp)
    if arch.n_heads % job.tp or arch.n_kv_heads % job.tp:
        raise HardyError(f"tp = {job.tp} must divide the {arch.n_heads} attention and {arch.n_kv_heads} KV heads")
    if job.pp > arch.n_layers:
        raise HardyError(f"pp = {job.pp} exceeds the model's {arch.n_layers} layers")
    if job.seq > arch.max_seq_len and arch.family == "llama":
        raise HardyError(f"sequence length {job.seq} exceeds the model's context of {arch.max_seq_len}")
    seqs = job.global_batch_tokens / job.seq
    m = seqs / dp / job.micro_batch
    if seqs != int(seqs) or m != int(m) or m < 1:
        raise HardyError(f"global batch of {job.global_batch_tokens} tokens = {seqs:g} sequences of {job.seq} does "
                         f"not split into dp = {dp} replicas × micro-batches of {job.micro_batch}")
    recompute, fraction = parse_ac(job.ac)
    if recompute == "selective_op" and arch.family != "llama":
        raise HardyError(f"--ac selective-op is torchtitan's policy for Llama models; {arch.name} is GPT-style "
                         "(its selective is Korthikanti et al.'s)")
    return Layout(dp, shard_dp, dims, int(m), recompute, fraction, v)


def loss_kind(job: TrainJob) -> str:
    """The loss the plan models: hardy's fused chunked loss for Llama unless asked otherwise; GPT-style
    models keep fp32 logits."""
    return job.loss or ("chunked" if job.arch.family == "llama" else "full")


def activation_bytes(job: TrainJob, lay: Layout) -> Stages:
    """Activation bytes held at the peak by the first and by the last pipeline stage."""
    arch = job.arch
    act = ActivationSetup(seq=job.seq // job.cp, micro_batch=job.micro_batch, tp=job.tp,
                          sequence_parallel=job.sequence_parallel, recompute="none", precision=job.precision,
                          cpu=job.hw.kind == "cpu", loss=loss_kind(job), sp_style=job.sp_style)
    layers = -(-arch.n_layers // job.pp)
    full_layer = layer_activation_bytes(arch, act, "none")
    if lay.recompute == "none":
        per_layer_avg, working = full_layer, 0.0
    else:
        kept = layer_activation_bytes(arch, act, lay.recompute)
        per_layer_avg = lay.recompute_fraction * kept + (1 - lay.recompute_fraction) * full_layer
        working = full_layer if lay.recompute == "full" else 0.0  # one layer recomputed at a time
    # In-flight micro-batches under 1F1B: the first stage holds p of them (L layers' worth);
    # interleaving multiplies that by 1 + (p−1)/(p·v) (Korthikanti et al. §4.2).
    inflight = min(lay.micro_batches, job.pp)
    interleave = 1 + (job.pp - 1) / (job.pp * lay.virtual_stages) \
        if job.pp > 1 and job.schedule == "interleaved" else 1.0
    act_first = layers * per_layer_avg * inflight * interleave + working
    # The loss's transient logits exist at the end of the forward, a recomputed layer's working
    # set during the backward: never both at once.
    out = output_activation_bytes(arch, act)
    act_last = layers * per_layer_avg + out.kept + max(working, out.transient)
    return Stages(act_first, act_last)


@dataclass(frozen=True)
class MemoryPlan:
    per_device: dict  # bytes by part at the busier stage's peak, and the peak
    host: float  # bytes of host memory per device (offloaded states)
    stage: str  # the busier pipeline stage: first or last


def memory_plan(job: TrainJob, lay: Layout, params_first: float, params_last: float) -> MemoryPlan:
    arch, hw = job.arch, job.hw
    params_local = max(params_first, params_last)
    act_first, act_last = activation_bytes(job, lay)
    states = {k: model_state_bytes(p, job.zero, lay.shard_dp, job.precision, job.offload, job.master_weights)
              for k, p in (("first", params_first), ("last", params_last))}
    g = state_bytes(job.precision, job.master_weights)[1]
    layer_params = arch.params_per_layer / job.tp
    buffers = 0.0
    if job.zero == 3 and lay.shard_dp > 1:  # the gathered layer, the next one prefetched, one unsharded gradient
        gathered = gathered_weight_bytes(job.precision, job.master_weights, job.fp8_all_gather)
        buffers += (2 * gathered + g) * layer_params
    foreach = job.optimizer_foreach if job.optimizer_foreach is not None else hw.kind == "gpu"
    # AdamW temporaries: the multi-tensor path materializes a step-sized copy of the parameters it
    # updates; the per-tensor path one copy of the largest tensor (the embedding).
    largest = max(arch.vocab_size * arch.dim, arch.params_per_layer / 3) / job.tp
    opt_local = params_local / (lay.shard_dp if job.zero >= 1 else 1)
    opt_temp = 0.0 if job.offload != "none" else 4 * (opt_local if foreach else min(largest, opt_local))
    peaks = {}
    for stage, acts in (("first", act_first), ("last", act_last)):
        st = states[stage]
        # Gradients outlive the step with a persistent buffer (Megatron/DeepSpeed), DDP's buckets, or
        # accumulation; hardy frees them after each step (set_to_none), and FSDP2 keeps only shards.
        kept = job.persistent_grads or lay.micro_batches > 1 or (lay.dp * job.cp > 1 and job.zero == 0)
        grads_during_backward = st["gradients"] if kept else 0.0
        fwd_bwd = st["weights"] + st["optimizer"] + grads_during_backward + acts + buffers
        opt_step = st["weights"] + st["optimizer"] + st["gradients"] + opt_temp
        peaks[stage] = (max(fwd_bwd, opt_step), acts, st)
    stage = max(peaks, key=lambda k: peaks[k][0])
    peak, acts, st = peaks[stage]
    overhead = hw.distributed_runtime_overhead_bytes if job.devices > 1 else hw.runtime_overhead_bytes
    memory = {"weights": st["weights"], "gradients": st["gradients"], "optimizer": st["optimizer"],
              "activations": acts, "buffers": buffers, "optimizer_temporaries": opt_temp,
              "runtime": overhead, "peak": peak + overhead}
    return MemoryPlan(memory, states["first"]["host"], stage)


def plan_train(job: TrainJob) -> TrainPlan:
    arch, hw = job.arch, job.hw
    lay = check_job(job)
    first, last = stage_params(arch, job.pp)
    params_first, params_last = first / job.tp, last / job.tp
    params_local = max(params_first, params_last)
    mem = memory_plan(job, lay, params_first, params_last)
    notes: list[str] = []
    if job.pp > 1:
        layers = -(-arch.n_layers // job.pp)
        notes.append(f"busiest pipeline stage: {mem.stage} ({layers} layers, "
                     f"{min(lay.micro_batches, job.pp)} micro-batches in flight)")
    step = step_time(arch, hw, StepSetup(seq=job.seq, micro_batch=job.micro_batch, micro_batches=lay.micro_batches,
                                         tp=job.tp, pp=job.pp, dp=lay.dp, zero=job.zero, recompute=lay.recompute,
                                         recompute_fraction=lay.recompute_fraction,
                                         sequence_parallel=job.sequence_parallel, precision=job.precision,
                                         virtual_stages=lay.virtual_stages, dp_replicate=job.dp_replicate,
                                         cp=job.cp, fp8=job.fp8, master_weights=job.master_weights,
                                         reduce_dtype=job.reduce_dtype, async_tp=job.async_tp,
                                         compiled=job.compile, schedule=job.schedule, loss=loss_kind(job),
                                         fp8_all_gather=job.fp8_all_gather),
                     params_local)
    fpt = arch.flops_per_token(job.seq)
    plan = TrainPlan(job=job, dims=lay.dims, micro_batches=lay.micro_batches, memory=mem.per_device, host_memory=mem.host,
                     params_local=params_local, step=step, flops_per_token=fpt,
                     model_flops_per_step=fpt * job.global_batch_tokens, reliability={}, notes=notes)
    plan.reliability = reliability(plan, shard_params=params_local / (lay.shard_dp if job.zero == 3 else 1))
    return plan


def checkpoint_bytes(arch: Arch, precision: str, master_weights: bool = True) -> float:
    """A full training checkpoint: weights + optimizer states (hardy/DCP saves the fp32 masters, which
    stand for the 16-bit weights; without them the 16-bit weights are saved)."""
    w, _, o = state_bytes(precision, master_weights)
    return arch.params_total * (o + (0 if precision != "fp32" and master_weights else w))


def reliability(plan: TrainPlan, shard_params: float) -> dict[str, float]:
    job = plan.job
    device_mtbf = job.device_mtbf_hours or job.hw.device_mtbf_hours or DEFAULT_DEVICE_MTBF_HOURS
    mtbf_s = device_mtbf * 3600 / (job.devices)
    nodes = max(1, math.ceil(job.devices / job.hw.devices_per_node))
    bw = (job.checkpoint_bandwidth or job.hw.disk_write_bandwidth) * nodes
    # Every node writes its share at once; a synchronous save stalls training for that long.
    saved = checkpoint_bytes(job.arch, job.precision, job.master_weights)
    stall = saved / bw
    interval = daly_interval(stall, mtbf_s)
    goodput = expected_goodput(interval, stall, mtbf_s, job.restart_s)
    expected_failures = (plan.train_time_s / goodput if goodput else 0.0) / mtbf_s
    return {"device_mtbf_hours": device_mtbf, "job_mtbf_s": mtbf_s, "checkpoint_bytes": saved, "checkpoint_stall_s": stall, "interval_s": interval,
        "interval_steps": max(1, round(interval / plan.step_s)), "restart_s": job.restart_s,
        "goodput": goodput, "expected_interruptions": expected_failures}


def fit_advice(plan: TrainPlan) -> str:
    """What would make a configuration that does not fit, fit."""
    device = plan.job.hw.memory_bytes
    short = plan.peak_memory - device
    tips = []
    if plan.job.ac == "none":
        tips.append("--ac full")
    if plan.job.zero < 3 and plan.dims.dp > 1:
        tips.append("--zero 3")
    if plan.job.micro_batch > 1:
        tips.append("a smaller --micro-batch")
    if plan.job.offload == "none":
        tips.append("--offload optimizer")
    tips.append("more devices (--tp/--pp), or --search")
    return (f"does not fit: needs {plan.peak_memory / 1e9:.1f} GB per device, {plan.job.hw.name} has "
            f"{device / 1e9:.1f} GB ({short / 1e9:.1f} GB short); try " + ", ".join(tips))


def search(base: TrainJob, rank_by: str = "time", limit: int = 10) -> tuple[list[TrainPlan], int]:
    """Every valid (tp, pp, zero, ac, micro-batch) for the device count that fits; best first.
    Returns (fitting plans, how many configurations were tried)."""
    arch, devices = base.arch, base.devices
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    fitting, tried = [], 0
    acs = ["none", "selective", "full"]
    for tp in [d for d in divisors if d <= base.hw.devices_per_node]:
        for pp in [d for d in divisors if devices % (tp * d) == 0 and d <= arch.n_layers]:
            for zero in (0, 1, 2, 3):
                for ac in acs:
                    for mb in (1, 2, 4, 8, 16):
                        # layout options asked for apply to the candidates that have what they need:
                        # async TP and the SP style where there is TP (async TP needs sequence
                        # parallelism), the fp8 all-gather where FSDP shards (ZeRO-3)
                        sp = tp > 1 and (arch.family == "gpt" or base.sequence_parallel or base.async_tp)
                        job = replace(base, tp=tp, pp=pp, dp=None, zero=zero, ac=ac, micro_batch=mb,
                                      sequence_parallel=sp, async_tp=base.async_tp and tp > 1,
                                      sp_style=base.sp_style if sp else "megatron",
                                      fp8_all_gather=base.fp8_all_gather and zero == 3)
                        tried += 1
                        try:
                            p = plan_train(job)
                        except HardyError:
                            continue
                        if p.fits:
                            fitting.append(p)
    key = (lambda p: p.cost if p.cost is not None else p.effective_time_s) if rank_by == "cost" else \
        (lambda p: p.effective_time_s if p.job.tokens else p.step_s / p.job.global_batch_tokens)
    fitting.sort(key=key)
    return fitting[:limit] if limit else fitting, tried


__all__ = ["TrainJob", "TrainPlan", "plan_train", "search", "fit_advice", "GiB", "ACT_BYTES"]
