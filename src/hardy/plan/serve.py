"""`hardy plan serve`: memory, latency, throughput and cost of serving a model (dense, or a mixture of
experts: a step reads only the experts its tokens are routed to, shared across a batch).

A roofline model of one request and of one decode step: a step takes the longer of streaming its
bytes at the achievable memory bandwidth and doing its FLOPs at the achievable FLOP/s, plus the
per-operator dispatch cost (hidden behind kernels on GPUs) and the tensor-parallel all-reduces,
which are not overlapped. Every formula and the assumption behind it is written out in
docs/planner-serve.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hardy.errors import HardyError
from hardy.model.config import ModelConfig, count_parameters
from hardy.plan.hardware import Hardware
from hardy.plan.timing import OPS_PER_LAYER, ring_allreduce
from hardy.plan.weights import WeightLayout

GROUP = 32  # int8/int4 group size along the reduction dimension (a multiple of 32 in every Llama)
# Bytes per weight with the quantization scales: int8 = 1 byte + one fp16 scale per group of 32
# (hardy's planned int8 g32 layout); int4 = 4 bits + fp16 scale + fp16 zero per group (GGUF Q4_1).
BYTES_PER_WEIGHT = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1 + 2 / GROUP, "int4": 0.5 + 4 / GROUP}
QUANTS = tuple(BYTES_PER_WEIGHT)
FILE = "file"  # the weights as a quantized GGUF file holds them (hardy.plan.weights)
KV_DTYPES = ("fp32", "fp16", "bf16", "int8")
RESERVE = 0.10  # of device memory kept for activations, logits, allocator slack and the runtime
SMALLER = {"fp32": ("fp16", "int8", "int4"), "fp16": ("int8", "int4"), "bf16": ("int8", "int4"),
           "int8": ("int4",), "int4": ()}


def kv_elem_bytes(kv_dtype: str, head_dim: int) -> float:
    """int8 KV keeps one fp16 scale per head vector (per token, per layer, per K or V)."""
    if kv_dtype == "int8":
        return 1 + 2 / head_dim
    return {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}[kv_dtype]


@dataclass(frozen=True)
class Shard:
    """The parameters one device holds under tensor parallelism over `devices` (Megatron layout:
    heads and FFN columns split, vocabulary split for the embedding and LM head, norms replicated)."""

    q_heads: int
    kv_heads: int
    kv_replicated: bool
    matmul: int  # attention + MLP matrices of all layers: quantized, read every step
    head: int  # the LM head (a tied embedding is only this): quantized, read every step
    embedding: int  # an untied input embedding: quantized, one row read per token
    norms: int  # RMSNorm weights: replicated, kept in 16 bits (32 for fp32)
    expert: int = 0  # of matmul: one expert's three matrices summed over the MoE layers (its share here)


def distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Experts a layer reads for `tokens` tokens that each pick `top_k` of `n_experts`, routed uniformly
    and independently: n (1 - (1 - k/n)^tokens). One token reads k; a batch shares the ones it repeats."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def shard(model: ModelConfig, devices: int) -> Shard:
    if devices < 1:
        raise HardyError(f"--devices must be >= 1 (got {devices})")
    if model.n_heads % devices:
        fits = [d for d in range(1, model.n_heads + 1) if model.n_heads % d == 0]
        raise HardyError(f"tensor parallelism over {devices} devices needs n_heads ({model.n_heads}) divisible "
                         f"by {devices}; use {', '.join(map(str, fits))} devices")
    q = model.n_heads // devices
    group = model.n_heads // model.n_kv_heads
    # A device needs every KV head its query heads read: n_kv / devices when that divides,
    # otherwise KV heads are replicated (each device keeps the ones its query heads use).
    kv = max(((i + 1) * q - 1) // group - (i * q) // group + 1 for i in range(devices))
    d, dh, L = model.dim, model.d_head, model.n_layers
    vocab = math.ceil(model.vocab_size / devices)
    counts = count_parameters(model)
    attention = L * (2 * d * q * dh + 2 * d * kv * dh)
    moe_layers = sum(model.is_moe(i) for i in range(L))
    mlp = (L - moe_layers) * 3 * d * math.ceil(model.ffn_dim / devices)
    expert = 0
    if model.moe is not None:  # experts split like a dense MLP's columns; routers and gates replicated
        m = model.moe
        expert = moe_layers * 3 * d * math.ceil(m.ffn_dim / devices)
        shared = 3 * d * math.ceil(m.shared_ffn_dim / devices) + (d if m.shared_gate else 0)
        mlp += m.n_experts * expert + moe_layers * (d * m.n_experts + shared)
    return Shard(q_heads=q, kv_heads=kv, kv_replicated=kv * devices > model.n_kv_heads, matmul=attention + mlp,
                 head=vocab * d, embedding=0 if model.tie_embeddings else vocab * d, norms=counts.norms,
                 expert=expert)


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "fp16", kv_heads: int | None = None) -> float:
    """K and V of every layer for one token of one sequence: 2 · L · n_kv · d_h · bytes."""
    kv = model.n_kv_heads if kv_heads is None else kv_heads
    return 2 * model.n_layers * kv * model.d_head * kv_elem_bytes(kv_dtype, model.d_head)


def weight_bytes(model: ModelConfig, quant: str, devices: int = 1) -> float:
    """Bytes of weights one device stores (at devices=1: the whole model)."""
    s = shard(model, devices)
    return (s.matmul + s.head + s.embedding) * BYTES_PER_WEIGHT[_quant(quant)] + s.norms * _norm_bytes(quant)


def _quant(quant: str) -> str:
    if quant not in BYTES_PER_WEIGHT:
        raise HardyError(f"unknown quant {quant!r} (choose from {', '.join(QUANTS)})")
    return quant


def _norm_bytes(quant: str) -> float:
    return 4.0 if quant == "fp32" else 2.0


@dataclass
class ServePlan:
    model: str
    hardware: str
    devices: int
    quant: str
    kv_dtype: str
    compute_dtype: str
    context: int
    prompt_tokens: int
    output_tokens: int
    batch: int
    max_batch: int
    reserve_fraction: float
    bytes_per_weight: float
    weight_bytes: float  # whole model
    weight_bytes_per_device: float
    kv_bytes_per_token: float  # whole model, one sequence
    kv_heads_per_device: int
    kv_replicated: bool
    kv_bytes_per_sequence_per_device: float  # at `context`
    memory_per_device: float  # weights + batch sequences of KV at `context`
    usable_memory_per_device: float
    prefill_s: float  # = time to first token on an idle server
    prefill_tokens_per_s: float
    step_s: float  # = time per output token
    step_memory_s: float
    step_compute_s: float
    step_dispatch_s: float  # the part of the per-operator host cost not hidden behind kernels
    step_allreduce_s: float
    step_bytes_per_device: float
    step_flops_per_device: float
    bound: str  # "memory bandwidth", "compute" or "dispatch" (the largest term of a step)
    decode_tokens_per_s: float  # per sequence
    decode_tokens_per_s_batch: float  # all sequences of the batch
    request_latency_s: float
    throughput_tokens_per_s: float  # output tokens, prefills included
    requests_per_s: float
    cost_per_hour: float | None
    cost_per_million_tokens: float | None
    max_batch_throughput_tokens_per_s: float
    max_batch_cost_per_million_tokens: float | None
    qps: float | None = None
    qps_sustained: bool | None = None
    qps_max: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        def cost(v):
            return "n/a (no price)" if v is None else f"${v:,.2f}"

        kv_split = "replicated" if self.kv_replicated else "split"
        rows = [
            ("model / hardware", f"{self.model} on {self.devices} × {self.hardware}"),
            ("weights / KV / compute dtype", f"{self.quant} ({self.bytes_per_weight:.4g} B/weight) / "
                                             f"{self.kv_dtype} / {self.compute_dtype}"),
            ("request", f"{self.prompt_tokens} prompt + {self.output_tokens} output tokens "
                        f"(context {self.context})"),
            ("weights", f"{_gb(self.weight_bytes)} total, {_gb(self.weight_bytes_per_device)} per device"),
            ("KV cache per token", f"{self.kv_bytes_per_token / 1024:,.1f} KiB per sequence; "
                                   f"{self.kv_heads_per_device} KV heads per device ({kv_split})"),
            ("KV cache per sequence", f"{_gb(self.kv_bytes_per_sequence_per_device)} per device at "
                                      f"context {self.context}"),
            ("memory per device", f"{_gb(self.memory_per_device)} of {_gb(self.usable_memory_per_device)} "
                                  f"usable ({self.reserve_fraction:.0%} reserved) at batch {self.batch}"),
            ("largest batch that fits", f"{self.max_batch:,}"),
            ("prefill (time to first token)", f"{_ms(self.prefill_s)} ({self.prefill_tokens_per_s:,.0f} "
                                              f"tokens/s)"),
            ("decode step (time per token)", f"{_ms(self.step_s)}, {self.bound}-bound (memory "
                                             f"{_ms(self.step_memory_s)}, compute {_ms(self.step_compute_s)}, "
                                             f"dispatch {_ms(self.step_dispatch_s)}"
                                             + (f", all-reduce {_ms(self.step_allreduce_s)})"
                                                if self.devices > 1 else ")")),
            ("decode tokens/s", f"{self.decode_tokens_per_s:,.1f} per sequence, "
                                f"{self.decode_tokens_per_s_batch:,.1f} for the batch of {self.batch}"),
            ("request latency", f"{self.request_latency_s:,.2f} s"),
            ("throughput", f"{self.throughput_tokens_per_s:,.1f} output tokens/s, "
                           f"{self.requests_per_s:,.3g} requests/s"),
            ("cost per 1M output tokens", cost(self.cost_per_million_tokens)),
            (f"at the largest batch ({self.max_batch:,})",
             f"{self.max_batch_throughput_tokens_per_s:,.1f} output tokens/s, "
             f"{cost(self.max_batch_cost_per_million_tokens)} per 1M"),
        ]
        if self.qps is not None:
            verdict = (f"sustained at batch {self.batch}" if self.qps_sustained else
                       f"NOT sustainable (at most {self.qps_max:,.3g} requests/s)")
            rows.append((f"{self.qps:g} requests/s", verdict))
        rows += [("note", n) for n in self.notes]
        return rows


def _experts(model: ModelConfig, s: Shard, devices: int, bpw: float, w_read: float, layout: WeightLayout | None):
    """(bytes the weights a pass over `tokens` tokens reads, the experts' part of them, matmul
    parameters one token uses, a note for the batch) — for a dense model all of them, for a mixture of
    experts only the experts routed to."""
    if model.moe is None or not s.expert:
        return (lambda tokens: w_read), (lambda tokens: 0.0), s.matmul, None
    m = model.moe
    if layout is not None and layout.expert_bytes:  # the file's own bytes, this device's share
        one = layout.expert_bytes / m.n_experts * s.expert / shard(model, 1).expert
    else:
        one = s.expert * bpw
    counts = count_parameters(model)

    def read(tokens: int) -> float:
        return w_read - (m.n_experts - distinct_experts(m.n_experts, m.top_k, tokens)) * one

    def note(batch: int) -> str:
        layers = sum(model.is_moe(i) for i in range(model.n_layers))
        return (f"experts: {m.n_experts} per layer, {m.top_k} active; {counts.total / 1e9:,.2f}B parameters, "
                f"{counts.active / 1e9:,.2f}B active per token; a decode step reads "
                f"{distinct_experts(m.n_experts, m.top_k, batch):,.1f} distinct experts per layer at batch {batch} "
                f"(uniform routing), {_gb(one / layers)} each per device")

    def expert_read(tokens: int) -> float:
        return distinct_experts(m.n_experts, m.top_k, tokens) * one

    return read, expert_read, s.matmul - (m.n_experts - m.top_k) * s.expert, note


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB" if x >= 1e8 else f"{x / 1e6:,.2f} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3g} ms" if s < 1 else f"{s:,.2f} s"


def compute_dtype_for(quant: str, hw: Hardware) -> str:
    """fp32 weights compute in fp32; 16-bit and weight-only int8/int4 in bf16 where it is native."""
    return "fp32" if quant == "fp32" or not hw.fast_bf16 else "bf16"


def stored_weights(model: ModelConfig, devices: int, quant: str,
                   layout: WeightLayout | None) -> tuple[float, float, float, float, float, bool]:
    """(bytes per weight, bytes per device, bytes in all, bytes a forward reads per device, bytes of
    one embedding row, quantized?) for one format for all matrices, or a file's own `layout`."""
    s = shard(model, devices)
    if layout is None:
        bpw = BYTES_PER_WEIGHT[quant]
        w_read = (s.matmul + s.head) * bpw + s.norms * _norm_bytes(quant)  # the input embedding is a lookup
        return (bpw, weight_bytes(model, quant, devices), weight_bytes(model, quant, 1), w_read, bpw * model.dim,
                quant in ("int8", "int4"))
    # the file's own bytes, split over devices as the planned shard splits the parameters
    full = shard(model, 1)
    matmul = layout.matmul_bytes * s.matmul / full.matmul
    head = layout.head_bytes * s.head / full.head
    embedding = layout.embedding_bytes * (s.embedding / full.embedding if full.embedding else 0.0)
    bpw = (layout.matmul_bytes + layout.head_bytes) / (full.matmul + full.head)
    return (bpw, matmul + head + embedding + layout.norm_bytes, layout.total, matmul + head + layout.norm_bytes,
            layout.embedding_bytes / model.vocab_size, layout.quantized)


def plan_serve(model: ModelConfig, hw: Hardware, devices: int = 1, quant: str = "fp16", context: int = 2048,
               output_tokens: int = 256, batch: int | None = None, qps: float | None = None,
               prompt_tokens: int | None = None, kv_dtype: str | None = None,
               layout: WeightLayout | None = None) -> ServePlan:
    """`layout` (with quant="file"): the bytes of the weights as loaded from a file, per kind of matrix,
    instead of one format for all; hardy keeps such a model's KV cache in fp32."""
    quant, kv_dtype, prompt = check_request(model, quant, layout, kv_dtype, context, output_tokens, prompt_tokens,
                                            batch, qps)

    s = shard(model, devices)
    bpw, w_dev, w_total, w_read, row_bytes, quantized = stored_weights(model, devices, quant, layout)
    compute = compute_dtype_for("fp32" if layout is not None and not hw.fast_bf16 else quant, hw)
    flops_rate = hw.achievable_flops(compute)
    bandwidth = hw.achievable_bandwidth()
    # batch-1 weight streaming (a probe measures it on CPUs; quantized weights at hardy's kernels' rate)
    decode_bandwidth = hw.decode_rate(model.dim, quantized=quantized)
    act_bytes = 4 if compute == "fp32" else 2
    link = hw.link(devices)
    ops = OPS_PER_LAYER["llama"] * model.n_layers + 20  # eager operators per forward (+ embedding, head)
    L, dim, dh = model.n_layers, model.dim, model.d_head

    row_read = 0.0 if model.tie_embeddings else row_bytes  # one embedding row per sequence per token
    weights_read, experts_read, active_matmul, moe_note = _experts(model, s, devices, bpw, w_read, layout)
    expert_bandwidth = hw.expert_rate(model.dim, quantized=quantized)
    kv_tok_dev = kv_bytes_per_token(model, kv_dtype, s.kv_heads)
    kv_seq_dev = kv_tok_dev * context
    usable = hw.memory_bytes * (1 - RESERVE)
    max_batch = math.floor((usable - w_dev) / kv_seq_dev) if usable > w_dev else 0
    if max_batch < 1:
        raise HardyError(_not_fit(model, hw, devices, quant, kv_dtype, context, w_dev + kv_seq_dev, usable))
    if batch is not None and batch > max_batch:
        raise HardyError(f"batch {batch} does not fit: {_gb(w_dev + batch * kv_seq_dev)} per device > "
                         f"{_gb(usable)} usable; the largest batch at context {context} is {max_batch}")

    # Prefill of one prompt: all its tokens through the matmuls, the LM head on the last position
    # only, causal attention over P(P+1)/2 query-key pairs; the weights are read once.
    pf_flops = 2 * active_matmul * prompt + 2 * s.head + 4 * L * s.q_heads * dh * prompt * (prompt + 1) / 2
    pf_bytes = weights_read(prompt) + row_read * prompt + kv_tok_dev * prompt
    pf_roof = max(pf_flops / flops_rate, pf_bytes / bandwidth)
    prefill = (pf_roof + dispatch_s(hw, ops, pf_roof)
               + 2 * L * ring_allreduce(prompt * dim * act_bytes, devices, link))

    # A decode step at the average context over the generation (the first token comes from prefill).
    avg_ctx = prompt + output_tokens / 2

    def step(b: int) -> DecodeStep:
        nbytes = weights_read(b) + b * (row_read + kv_tok_dev * avg_ctx)
        flops = b * (2 * (active_matmul + s.head) + 4 * L * s.q_heads * dh * avg_ctx)
        expert_bytes = experts_read(b)  # active experts stream at their own (measured) rate
        mem_s = (nbytes - expert_bytes) / decode_bandwidth + expert_bytes / expert_bandwidth
        comp_s = flops / flops_rate
        return DecodeStep(memory_s=mem_s, compute_s=comp_s, dispatch_s=dispatch_s(hw, ops, max(mem_s, comp_s)),
                          allreduce_s=2 * L * ring_allreduce(b * dim * act_bytes, devices, link),
                          bytes=nbytes, flops=flops)

    def latency(b: int) -> float:
        # Each request waits through b prefills (its own and those of the b - 1 sequences that share
        # its batch) and output_tokens - 1 decode steps.
        return b * prefill + (output_tokens - 1) * step(b).seconds

    notes: list[str] = []
    qps_sustained = qps_max = None
    if qps is not None:
        chosen = batch_for_qps(qps, max_batch, latency, notes)
        batch, qps_sustained, qps_max = chosen.batch, chosen.sustained, chosen.qps_max
    batch = batch or 1
    decode = step(batch)
    if moe_note is not None:
        notes.append(moe_note(batch))
    if layout is not None:
        notes.append(f"weights as the file holds them: {layout.types}")
    if s.kv_replicated:
        notes.append(f"{model.n_kv_heads} KV heads over {devices} devices: KV heads replicated, "
                     f"{s.kv_heads} per device")
    if quant in ("fp16", "bf16") and compute == "fp32":
        notes.append(f"{hw.name} has no fast bf16/fp16 matmul: 16-bit weights computed in fp32")
    price = None if hw.price_per_device_hour is None else hw.price_per_device_hour * devices

    def per_million(tokens_per_s: float) -> float | None:
        return None if price is None else price / 3600 / tokens_per_s * 1e6

    req_latency = latency(batch)
    throughput = batch * output_tokens / req_latency
    max_throughput = max_batch * output_tokens / latency(max_batch)
    return ServePlan(
        model=model.name, hardware=hw.name, devices=devices, quant=quant, kv_dtype=kv_dtype, compute_dtype=compute,
        context=context, prompt_tokens=prompt, output_tokens=output_tokens, batch=batch, max_batch=max_batch,
        reserve_fraction=RESERVE, bytes_per_weight=bpw, weight_bytes=w_total,
        weight_bytes_per_device=w_dev, kv_bytes_per_token=kv_bytes_per_token(model, kv_dtype),
        kv_heads_per_device=s.kv_heads, kv_replicated=s.kv_replicated, kv_bytes_per_sequence_per_device=kv_seq_dev,
        memory_per_device=w_dev + batch * kv_seq_dev, usable_memory_per_device=usable,
        prefill_s=prefill, prefill_tokens_per_s=prompt / prefill, step_s=decode.seconds, step_memory_s=decode.memory_s,
        step_compute_s=decode.compute_s, step_dispatch_s=decode.dispatch_s, step_allreduce_s=decode.allreduce_s,
        step_bytes_per_device=decode.bytes, step_flops_per_device=decode.flops,
        bound=_bound(decode.memory_s, decode.compute_s, ops * hw.op_overhead_s), decode_tokens_per_s=1 / decode.seconds,
        decode_tokens_per_s_batch=batch / decode.seconds, request_latency_s=req_latency,
        throughput_tokens_per_s=throughput, requests_per_s=batch / req_latency, cost_per_hour=price,
        cost_per_million_tokens=per_million(throughput), max_batch_throughput_tokens_per_s=max_throughput,
        max_batch_cost_per_million_tokens=per_million(max_throughput), qps=qps, qps_sustained=qps_sustained,
        qps_max=qps_max, notes=notes)


def check_request(model: ModelConfig, quant: str, layout, kv_dtype: str | None, context: int, output_tokens: int,
                  prompt_tokens: int | None, batch: int | None, qps: float | None) -> tuple[str, str, int]:
    """(quant, KV dtype, prompt tokens) of a request, or a one-line error naming what cannot be."""
    if (quant == FILE) != (layout is not None):
        raise HardyError("--quant file plans a quantized .gguf file as hardy loads it (give the file as --model)")
    if layout is None:
        quant = _quant(quant)
    kv_dtype = kv_dtype or ("fp32" if quant in ("fp32", FILE) else "fp16")
    if kv_dtype not in KV_DTYPES:
        raise HardyError(f"unknown KV cache dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
    if batch is not None and qps is not None:
        raise HardyError("give --batch or --qps, not both")
    if output_tokens < 1 or context < 2:
        raise HardyError(f"--output-tokens must be >= 1 and --context >= 2 (got {output_tokens}, {context})")
    if context > model.max_seq_len:
        raise HardyError(f"--context {context} exceeds {model.name}'s maximum of {model.max_seq_len} tokens")
    # Default request: a prompt that fills the context up to the output.
    prompt = context - output_tokens if prompt_tokens is None else prompt_tokens
    if prompt < 1 or prompt + output_tokens > context:
        raise HardyError(f"prompt ({prompt}) + output ({output_tokens}) tokens must fit the context ({context}); "
                         "a prompt needs at least 1 token")
    if batch is not None and batch < 1:
        raise HardyError(f"--batch must be >= 1 (got {batch})")
    if qps is not None and not qps > 0:
        raise HardyError(f"--qps must be > 0 (got {qps})")
    return quant, kv_dtype, prompt


@dataclass(frozen=True)
class DecodeStep:
    """One decode step of a batch on one device: the roofline's two sides, host dispatch, all-reduces."""
    memory_s: float
    compute_s: float
    dispatch_s: float
    allreduce_s: float
    bytes: float  # read per device
    flops: float  # per device

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.dispatch_s + self.allreduce_s


@dataclass(frozen=True)
class QpsBatch:
    batch: int  # the smallest batch that sustains the rate, else the largest
    sustained: bool
    qps_max: float  # the most requests/s the largest batch completes


def batch_for_qps(qps: float, max_batch: int, latency, notes: list[str]) -> QpsBatch:
    """The smallest batch whose capacity, batch / latency(batch) by Little's law, reaches `qps`, else
    the largest; a note says which."""
    def capacity(b: int) -> float:
        return b / latency(b)

    qps_max = capacity(max_batch)  # capacity grows with the batch: per-step cost per sequence falls
    if qps > qps_max:
        notes.append(f"cannot sustain {qps:g} requests/s: at most {qps_max:.3g} at the largest batch "
                     f"({max_batch}); about {math.ceil(qps / qps_max)} replicas of this setup would")
        return QpsBatch(max_batch, False, qps_max)
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if capacity(mid) >= qps else (mid + 1, hi)
    notes.append(f"{qps:g} requests/s × {latency(lo):.2f} s latency = "
                 f"{qps * latency(lo):.1f} requests in flight (Little's law) <= batch {lo}")
    return QpsBatch(lo, True, qps_max)


def dispatch_s(hw: Hardware, ops: int, kernels_s: float) -> float:
    """Host cost of `ops` eager operators: on a CPU it runs on the same cores, before each kernel;
    GPU launches are asynchronous, so only what exceeds the kernels' own time shows."""
    total = ops * hw.op_overhead_s
    return total if hw.kind != "gpu" else max(0.0, total - kernels_s)


def _bound(mem_s: float, comp_s: float, dispatch: float) -> str:
    return max((mem_s, "memory bandwidth"), (comp_s, "compute"), (dispatch, "dispatch"))[1]


def _fits(model: ModelConfig, hw: Hardware, devices: int, quant: str, kv_dtype: str, context: int) -> bool:
    s = shard(model, devices)
    need = weight_bytes(model, quant, devices) + kv_bytes_per_token(model, kv_dtype, s.kv_heads) * context
    return need <= hw.memory_bytes * (1 - RESERVE)


def _not_fit(model, hw, devices, quant, kv_dtype, context, need, usable) -> str:
    """One line: by how much batch 1 misses, and the device counts or quants that would fit."""
    if quant == FILE:  # the file's own formats: only more devices change its size per device
        return (f"{model.name} (as the file holds it) does not fit on {devices} × {hw.name}: {_gb(need)} per device "
                f"for weights + one {context}-token sequence of KV > {_gb(usable)} usable; more --devices split it")
    ways = []
    more = next((d for d in range(devices + 1, model.n_heads + 1)
                 if model.n_heads % d == 0 and _fits(model, hw, d, quant, kv_dtype, context)), None)
    ways.append(f"{more} devices (tensor parallel)" if more else
                f"no device count up to {model.n_heads} with {quant}")
    for q in SMALLER[quant]:
        if _fits(model, hw, devices, q, kv_dtype, context):
            ways.append(f"{q} on {devices} device{'s' * (devices > 1)}")
            break
        d = next((d for d in range(devices + 1, model.n_heads + 1)
                  if model.n_heads % d == 0 and _fits(model, hw, d, q, kv_dtype, context)), None)
        if d:
            ways.append(f"{q} on {d} devices")
    return (f"{model.name} ({quant}) does not fit on {devices} × {hw.name}: {_gb(need)} per device for weights "
            f"+ one {context}-token sequence of KV > {_gb(usable)} usable ({hw.memory_bytes / 1e9:.0f} GB less "
            f"{RESERVE:.0%} reserve), short by {(need - usable) / 1e9:,.2f} GB; fits with {'; or '.join(ways)}")
