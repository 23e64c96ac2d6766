"""Step time: compute roofline + exposed communication + pipeline bubble + optimizer step.

Per micro-batch and pipeline stage, each layer costs
  GEMMs        hardware FLOPs ÷ achievable FLOP/s (recompute adds a forward, or the attention core)
  elementwise  bytes moved by norms, activations, softmax, dropout, residuals ÷ achievable bandwidth
  TP           4 all-reduces of the layer's activations (2 forward, 2 backward; +2 with full recompute),
               or as many all-gather + reduce-scatter pairs with sequence parallelism — not overlapped,
               but under async TP, where each shows only where it outlasts the GEMM it feeds or drains
  dispatch     a per-operator host cost (CPU: Python + ATen dispatch, on the same cores; GPU: launch
               latency, hidden behind kernels unless they are shorter)
A step is (m + (p−1)/v) micro-batch times of the slowest stage (1F1B, v = virtual stages when
interleaved), plus data-parallel gradient synchronization not hidden behind the last backward,
plus the optimizer update (memory-bound: every state byte read and written once).
"""
from __future__ import annotations

from dataclasses import dataclass

from hardy.plan.arch import Arch
from hardy.plan.hardware import Hardware, Link
from hardy.plan.memory import ACT_BYTES, gathered_weight_bytes, state_bytes

# Operators per transformer layer forward in the two implementations (backward ≈ 2× as many).
OPS_PER_LAYER = {"llama": 30, "gpt": 24}
# Operators per parameter tensor in the optimizer step on CPU (torch's per-tensor AdamW: 10, plus the
# gradient norm and clipping scale), where each costs a dispatch.
OPTIMIZER_OPS_PER_TENSOR = 12
# Memory traffic of the optimizer step per parameter: AdamW reads the gradient and reads + writes
# the (master) weight, m and v (4 + 3 × 8); gradient clipping reads every gradient and zeroing
# writes it (4 + 4); mixed precision also writes the 16-bit weight copy (2) and accumulates the
# 16-bit gradient into an fp32 main gradient (2 + 8).
ADAM_BYTES_PER_PARAM = {"fp32": 28 + 8, "bf16": 28 + 8 + 2 + 10, "fp16": 28 + 8 + 2 + 10}
# Without master weights everything is 16-bit: the gradient read, weight, m and v read and written
# (2 + 3 × 4), clipping's read and zeroing's write (2 + 2).
NO_MASTER_ADAM_BYTES_PER_PARAM = 2 + 12 + 4


def param_tensors(arch: Arch, layers: int) -> int:
    """Parameter tensors of a pipeline stage of `layers` layers (plus embedding, final norm, head)."""
    return layers * (9 if arch.family == "llama" else 12) + 3


def ring_allreduce(nbytes: float, group: int, link: Link) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (group - 1) / group * nbytes / (link.bandwidth * link.efficiency) + 2 * (group - 1) * link.latency


def ring_allgather(nbytes: float, group: int, link: Link) -> float:
    """All-gather (or reduce-scatter) whose full result is `nbytes`."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (group - 1) / group * nbytes / (link.bandwidth * link.efficiency) + (group - 1) * link.latency


@dataclass(frozen=True)
class StepSetup:
    seq: int
    micro_batch: int
    micro_batches: int  # per step, per data-parallel replica (gradient accumulation / pipeline m)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    recompute: str = "none"  # none | selective | full
    recompute_fraction: float = 1.0  # share of layers recomputed (every:K → 1/K)
    sequence_parallel: bool = False
    precision: str = "bf16"
    virtual_stages: int = 1  # interleaved 1F1B
    schedule: str = "1f1b"  # 1f1b | interleaved | zb-h1 (the pipeline's bubble)
    devices_per_process: float = 1.0  # CPU hosts: a process's share of the probed machine
    dp_replicate: int = 1  # HSDP: ZeRO-3 within groups of dp / dp_replicate, replicated across them
    cp: int = 1  # context parallel: each sequence split over cp ranks (ring attention, load-balanced causal)
    fp8: str = "none"  # none | tensorwise | rowwise: the layers' linear GEMMs in fp8 (torchao float8 training)
    master_weights: bool = True  # False: 16-bit weights and optimizer states, no fp32 copy
    reduce_dtype: str = "fp32"  # the gradients' data-parallel reduction (fp32 or bf16)
    async_tp: bool = False  # sequence parallel's collectives overlapped with their GEMMs (needs it)
    compiled: bool = False  # each Llama block torch.compile'd: its elementwise operators fused
    loss: str = "chunked"  # a Llama model's loss: hardy's fused chunked one, "full" fp32 logits, "compiled"
    fp8_all_gather: bool = False  # FSDP gathers the fp8 linears' weights in fp8 (torchao, tensorwise)

    @property
    def dp_shard(self) -> int:
        """Ranks a state shards over and gradients reduce across: the data-parallel ones in a sharding
        group, times the context-parallel ones (which see other tokens of the same sequences)."""
        return self.dp // self.dp_replicate * self.cp

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element on the wire: bf16 only where asked for, on a bf16 run."""
        return 2 if self.reduce_dtype == "bf16" and self.precision == "bf16" else 4

    @property
    def tokens(self) -> int:
        """Tokens of a micro-batch on one device: its share of each sequence under context parallelism."""
        return self.seq * self.micro_batch // self.cp


def compute_dtype(hw: Hardware, precision: str) -> str:
    return precision if precision in hw.peak_flops else "fp32"


def layer_gemm_flops(arch: Arch, s: StepSetup) -> tuple[float, float]:
    """(forward GEMM FLOPs of one layer on one TP rank, of which the attention core)."""
    tokens = s.tokens
    matmul_params = arch.layer_matmul_params()
    # Q·K^T and P·V: 4·s·(a·d_h) per token; a causal flash kernel (hardy's SDPA) skips the masked half.
    # Under context parallelism each rank's queries meet all s keys, the causal half balanced over ranks.
    core = 4 * tokens * s.seq * arch.q_dim * (0.5 if arch.flash_attention else 1.0)
    return (2 * tokens * matmul_params + core) / s.tp, core / s.tp


# Elements moved per token by one Llama layer's non-GEMM operators, forward + backward, counted on
# hardy's eager implementation with `hardy.ops.kernel_probe.ElementwiseTraffic` (inputs + outputs of
# every operator that is not a GEMM, attention or a view): norms, RoPE, attention layout copies,
# SwiGLU, residual adds, and their gradients. tests/test_plan_timing.py recounts it.
LLAMA_LAYER_ELEMENTS = {"h": 84, "f": 14.5, "q": 23, "kv": 25}
# The same layer compiled (torch.compile of each block, as torchtitan applies it): what inductor's fused
# kernels read and write, by its own per-kernel count (`hardy.ops.compiled_traffic`), least squares over
# seven shapes (within 1.2% of each; bench/compiled_traffic.py); tests/test_plan_compile.py recounts it
# on a shape outside the fit.
# A forward + backward launches 42-47 kernels (the most taken) where eager runs 78 operators
# (bench/compiled_traffic.py prints both counts).
LLAMA_COMPILED_LAYER_ELEMENTS = {"h": 28.3, "f": 7.8, "q": 10.1, "kv": 8.5}
LLAMA_COMPILED_KERNELS_PER_LAYER = 47
# Around the layers, per token: embedding lookup, final norm, the fused loss over the vocabulary;
# per micro-batch: the embedding gradient (zeroed, scattered into, added to the tied head's).
LLAMA_MODEL_ELEMENTS = {"h": 37, "v": 8, "vh_per_microbatch": 10}
# Bytes per logit of torchtitan's loss, cross_entropy over the logits' fp32 copy, forward + backward:
# the copy, log_softmax, nll_loss and their gradients back to the 16-bit logits, counted with
# `ElementwiseTraffic` (tests/test_plan_loss.py recounts it). It replaces the fused loss's v·e.
# Compiled, inductor's kernels read the logits in the forward and read them and write their gradient in
# the backward (`hardy.ops.compiled_traffic`, recounted by the same test).
LOSS_BYTES_PER_LOGIT = {"full": 44, "compiled": 8}


def layer_elementwise_bytes(arch: Arch, s: StepSetup, scores_only: bool = False) -> float:
    """Bytes moved by the non-GEMM operators of one layer, forward + backward, on one TP rank.

    Llama: hardy's measured count (above); its flash attention never materializes scores. GPT
    (Megatron 2022, backward ≈ 2× forward), per token forward: each norm reads and writes h,
    residual adds read 2h and write h, GeLU reads f and writes f, dropout on h, and the unfused
    softmax and dropout each read and write a·s scores.
    """
    h, e, tokens = arch.dim, ACT_BYTES[s.precision], s.tokens
    if arch.family == "llama":
        if scores_only:
            return 0.0
        c = LLAMA_COMPILED_LAYER_ELEMENTS if s.compiled else LLAMA_LAYER_ELEMENTS
        split = c["f"] * arch.ffn_dim + c["q"] * arch.q_dim + c["kv"] * arch.kv_dim
        replicated = c["h"] * h  # norms and residuals: replicated under TP unless sequence-parallel
        return tokens * (split / s.tp + replicated / (s.tp if s.sequence_parallel else 1)) * e
    # softmax + dropout over the s scores of every head (none leave a flash kernel)
    scores = 0 if arch.flash_attention else 2 * 2 * arch.n_heads * s.seq
    if scores_only:
        return 3 * tokens * scores / s.tp * e
    per_token = 2 * 2 * h + 2 * 3 * h + 2 * arch.ffn_dim + (2 * h if arch.dropout else 0)
    replicated = 2 * 2 * h + 2 * 3 * h
    split_part = (per_token - replicated + scores) / s.tp
    rep_part = replicated / (s.tp if s.sequence_parallel else 1)
    return 3 * tokens * (split_part + rep_part) * e


def model_elementwise_bytes(arch: Arch, s: StepSetup) -> float:
    """Bytes moved outside the layers per micro-batch (last pipeline stage): the loss over the
    vocabulary, embedding and final norm."""
    tokens = s.tokens
    if arch.family == "llama":
        c, e = LLAMA_MODEL_ELEMENTS, ACT_BYTES[s.precision]
        per_logit = LOSS_BYTES_PER_LOGIT.get(s.loss, c["v"] * e)
        return (c["h"] * arch.dim * e * tokens + per_logit * arch.vocab_size / s.tp * tokens
                + c["vh_per_microbatch"] * arch.vocab_size * arch.dim / s.tp * e)
    return 3 * 2 * tokens * arch.vocab_size * 4 / s.tp  # fp32 logits: softmax forward and backward


def tp_comm_per_layer(arch: Arch, s: StepSetup, link: Link, gemm_rate: float = 0.0) -> float:
    """Exposed tensor-parallel seconds of one layer, one micro-batch. `gemm_rate`: FLOP/s of the
    projections, which async TP hides the collectives behind."""
    if s.tp <= 1:
        return 0.0
    nbytes = s.tokens * arch.dim * ACT_BYTES[s.precision]
    # Forward and backward run two collectives of each kind per layer. Recompute replays the forward's:
    # full recompute all of them; torchtitan's op-level policy saves the reduce-scatters' outputs (its
    # save list) but not the all-gathers' or all-reduces', which run again.
    replayed = 2 * s.recompute_fraction if s.recompute in ("full", "selective_op") else 0.0
    gathers, scatters = 4 + replayed, 4 + (replayed if s.recompute == "full" else 0.0)
    if not s.sequence_parallel:
        return gathers * ring_allreduce(nbytes, s.tp, link)
    gather, scatter = ring_allgather(nbytes * tp_gather_scale(s), s.tp, link), ring_allgather(nbytes, s.tp, link)
    if s.async_tp:
        return async_tp_exposed(arch, s, gather, scatter, gemm_rate)
    return gathers * gather + scatters * scatter


def tp_gather_scale(s: StepSetup) -> float:
    """Bytes of a sequence-parallel all-gather relative to the activations': torchao's float8 TP casts a
    column-parallel linear's input (forward) and a row-parallel one's output gradient (backward) to fp8
    before gathering them (tensorwise scaling); the reduce-scatters stay 16-bit."""
    return 1 / ACT_BYTES[s.precision] if s.fp8 == "tensorwise" else 1.0


def async_tp_exposed(arch: Arch, s: StepSetup, gather_s: float, scatter_s: float, gemm_rate: float) -> float:
    """Exposed seconds of one layer's sequence-parallel collectives under async TP as torchtitan runs it:
    inductor's micro-pipeline TP pass (torch/_inductor/fx_passes/micro_pipeline_tp.py) cuts a collective into
    one chunk per TP rank and runs the GEMM it feeds or drains on one chunk while the next moves, so each of
    the tp − 1 transfers shows only where it outlasts a chunk's GEMM. The pass fuses an all-gather with the
    matmuls that take it as their left operand, and a reduce-scatter with the single matmul that produces it:
    - forward: the all-gathers into QKV and gate/up, and out and down into their reduce-scatters;
    - backward: out's and down's output gradients all-gathered into their input-gradient GEMMs; QKV's and
      gate/up's input gradients are sums of several matmuls (q, k and v; gate and up), which the pass does
      not fuse, so those two reduce-scatters stay whole;
    - recompute replays the forward's fused collectives (full: all four; op-level: its two all-gathers).
    The GEMMs cut into tp pieces are assumed to keep their rate."""
    mlp_in = (2 if arch.family == "llama" else 1) * arch.dim * arch.ffn_dim
    qkv, out, up, down = (arch.dim * (arch.q_dim + 2 * arch.kv_dim), arch.q_dim * arch.dim, mlp_in,
                          arch.ffn_dim * arch.dim)
    t = s.tp

    def shows(collective: float, weights: float) -> float:
        chunk = 2 * s.tokens * weights / t / t / gemm_rate
        return (t - 1) * max(0.0, collective / (t - 1) - chunk)

    forward_gathers = shows(gather_s, qkv) + shows(gather_s, up)
    forward = forward_gathers + shows(scatter_s, out) + shows(scatter_s, down)
    backward = shows(gather_s, out) + shows(gather_s, down) + 2 * scatter_s
    replayed = {"full": forward, "selective_op": forward_gathers}.get(s.recompute, 0.0) * s.recompute_fraction
    return forward + backward + replayed


def layer_seconds(arch: Arch, hw: Hardware, s: StepSetup) -> dict[str, float]:
    """One layer, forward + backward (+ recompute), one micro-batch, on one device: GEMM,
    elementwise and tensor-parallel seconds, and its hardware FLOPs. Projections run at the GEMM rate
    for the model's width; Llama's flash-attention core at the attention rate for its head size
    (GPT's unfused core is GEMMs)."""
    dtype = compute_dtype(hw, s.precision)
    fwd, core = layer_gemm_flops(arch, s)
    # GPT-style selective recompute (Korthikanti et al.) recomputes the attention core; hardy's Llama
    # op-level selective keeps matmul and attention outputs and recomputes only elementwise operators.
    selective_core = core if arch.family == "gpt" else 0.0
    op_level = 2 * s.tokens * arch.op_recomputed_matmul_params() / s.tp if arch.family == "llama" else 0.0
    extra_proj = {"none": 0.0, "full": fwd - core, "selective": 0.0,
                  "selective_op": op_level}[s.recompute] * s.recompute_fraction
    extra_core = {"none": 0.0, "full": core, "selective": selective_core,
                  "selective_op": 0.0}[s.recompute] * s.recompute_fraction
    proj, attn = 3 * (fwd - core) + extra_proj, 3 * core + extra_core
    gemm_rate = hw.gemm_rate(dtype, arch.dim)
    attn_rate = hw.attention_rate(dtype, arch.head_dim) if arch.flash_attention else gemm_rate
    proj_rate = hw.gemm_rate("fp8", arch.dim) if s.fp8 != "none" else gemm_rate  # the attention core stays bf16
    elem = layer_elementwise_bytes(arch, s)
    if s.recompute == "full":  # the forward (a third of the traffic) runs twice
        elem *= 1 + s.recompute_fraction / 3
    elif s.recompute == "selective" and arch.family == "gpt":  # softmax and dropout over the scores run twice
        elem += s.recompute_fraction / 3 * layer_elementwise_bytes(arch, s, scores_only=True)
    elif s.recompute in ("selective", "selective_op"):  # the forward's norms, RoPE and activations run twice
        elem *= 1 + s.recompute_fraction / 3
    elem += fp8_cast_bytes(arch, s) * (1 + (s.recompute_fraction / 3 if s.recompute == "full" else 0))
    return {"flops": proj + attn, "forward_flops": fwd, "gemm": proj / proj_rate + attn / attn_rate,
            "weight_grad": (fwd - core) / proj_rate,
            "elementwise": elem / hw.elementwise_rate(),
            "tp": (tp_comm_per_layer(arch, s, hw.link(s.tp), proj_rate)
                   + ring_attention_exposed(arch, hw, s, attn / attn_rate))}


# Bytes moved per element to scale and cast a linear's operand to fp8 and back into the layout the
# backward's GEMM needs, counted from the recipes (not measured; unfused, as eager runs them):
# tensorwise: the amax (read 2), the cast (read 2, write 1), and a transposed cast for the backward
# (read 2, write 1), the scale shared; rowwise: each of the two casts scales along its own axis, so
# each reads for its amax and again to cast (2 + 2 + 1, twice).
FP8_CAST_BYTES = {"tensorwise": 8, "rowwise": 10}


def fp8_cast_bytes(arch: Arch, s: StepSetup) -> float:
    """Cast traffic of one layer's fp8 linears, forward + backward, per micro-batch on one device:
    every linear's input, its output gradient and its weight (torchao casts each linear's input on its
    own, so Llama's separate q, k, v read the same input three times, w1 and w3 twice)."""
    if s.fp8 == "none":
        return 0.0
    h, q, kv, f = arch.dim, arch.q_dim, arch.kv_dim, arch.ffn_dim
    if arch.family == "llama":  # wq wk wv (in h) wo (in q) w1 w3 (in h) w2 (in f)
        inputs, grads = 5 * h + q + f, (q + 2 * kv) + h + 2 * f + h
    else:  # fused qkv (in h), the projection (in h), fc1 (in h), fc2 (in f)
        inputs, grads = 3 * h + f, (q + 2 * kv) + h + f + h
    elements = s.tokens * (inputs + grads) + arch.layer_matmul_params()
    return FP8_CAST_BYTES[s.fp8] * elements / s.tp


def ring_attention_exposed(arch: Arch, hw: Hardware, s: StepSetup, core_s: float) -> float:
    """Context parallelism's K/V exchange for one layer, fwd + bwd, beyond what the attention core hides.
    Ring attention passes each rank's K and V chunk around the cp ranks: cp − 1 hops forward; backward
    passes K and V again with their gradients (3× the forward's bytes). Each hop overlaps the attention
    on the chunk already there, so only what exceeds the core's time shows."""
    if s.cp <= 1:
        return 0.0
    link = hw.link(s.cp * s.tp)
    chunk = 2 * s.tokens * arch.kv_dim / s.tp * ACT_BYTES[s.precision]  # this rank's K and V
    hop = chunk / (link.bandwidth * link.efficiency) + link.latency
    return max(0.0, 4 * (s.cp - 1) * hop - core_s)


@dataclass
class StepTime:
    compute_s: float  # GEMMs, per step on the busiest device
    elementwise_s: float
    dispatch_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float  # exposed part
    optimizer_s: float
    hardware_flops: float  # per step per device, with recompute
    total_s: float = 0.0

    def __post_init__(self):
        self.total_s = (self.compute_s + self.elementwise_s + self.dispatch_s + self.tp_comm_s + self.pp_comm_s
                        + self.bubble_s + self.dp_comm_s + self.optimizer_s)


def data_parallel_seconds(hw: Hardware, s: StepSetup, params_local: float, layers: int) -> float:
    """The data-parallel collectives of one step, before any overlap: the gradients' all-reduce (or
    reduce-scatter from ZeRO-2 on), ZeRO-3's parameter all-gathers (forward and backward, every
    micro-batch, one per layer), ZeRO-1/2's all-gather of the updated shards, and under HSDP the
    all-reduce of each gradient shard across the replica groups. Context-parallel ranks join the
    sharding group (they hold gradients of other tokens of the same sequences)."""
    w_bytes = state_bytes(s.precision, s.master_weights)[0]
    shard, link = s.dp_shard, _shard_link(hw, s)
    if s.zero == 3:
        gather, reduce = zero3_layer_collectives(hw, s, params_local / layers)
        return layers * (2 * gather * s.micro_batches + reduce)
    if s.zero == 2:
        total = ring_allgather(s.reduce_bytes * params_local, shard, link)  # reduce-scatter of gradients
    else:
        total = ring_allreduce(s.reduce_bytes * params_local, shard, link)
    if s.zero >= 1:  # updated shards are all-gathered back
        total += ring_allgather(w_bytes * params_local, shard, link)
    return total + _replicate_seconds(hw, s, params_local)


def _shard_link(hw: Hardware, s: StepSetup) -> Link:
    """The sharding group's fabric: its ranks are tp apart (TP innermost, pipeline stages outermost, as
    torchtitan's and Megatron's meshes order them), so a node holds devices_per_node ÷ tp of them."""
    return hw.group_link(s.dp_shard * s.tp, hw.devices_per_node // s.tp)


def _replicate_seconds(hw: Hardware, s: StepSetup, params: float) -> float:
    """HSDP: each device's gradient shard all-reduced across the replica groups (spanning the job)."""
    if s.dp_replicate <= 1:
        return 0.0
    link = hw.group_link(s.dp * s.cp * s.tp, hw.devices_per_node // (s.dp_shard * s.tp))
    return ring_allreduce(s.reduce_bytes * params / s.dp_shard, s.dp_replicate, link)


def zero3_layer_collectives(hw: Hardware, s: StepSetup, layer_params: float) -> tuple[float, float]:
    """(one all-gather of a layer's parameters, its gradients' reduce-scatter plus HSDP's all-reduce)."""
    shard, link = s.dp_shard, _shard_link(hw, s)
    gather = ring_allgather(gathered_weight_bytes(s.precision, s.master_weights, s.fp8_all_gather) * layer_params,
                            shard, link)
    reduce = ring_allgather(s.reduce_bytes * layer_params, shard, link) + _replicate_seconds(hw, s, layer_params)
    return gather, reduce


def zero3_exposed_seconds(hw: Hardware, s: StepSetup, layer_params: float, layers: int, forward_s: float,
                          backward_s: float) -> float:
    """ZeRO-3 (FSDP) communication a GPU step waits on. Each layer's parameters are all-gathered before its
    forward and again before its backward, and its gradients reduce-scattered after it, on the last
    micro-batch only (gradient accumulation without sync, as hardy's trainer and KempnerForge do). The
    collectives of the next layer run while this one computes (one layer of prefetch), so a layer's
    traffic shows only where it outlasts the layer's compute (`forward_s`, `backward_s`: one layer, one
    micro-batch, recompute in the backward), plus the first gather and the last reduce-scatter, which
    have nothing to hide behind (the backward's first gather runs behind the output layer's backward).
    Gathers and reduce-scatters share the link: their times add."""
    gather, reduce = zero3_layer_collectives(hw, s, layer_params)
    hidden = max(0, layers - 1)
    forward = gather + hidden * max(0.0, gather - forward_s)
    backward_accumulating = hidden * max(0.0, gather - backward_s)
    backward_reducing = hidden * max(0.0, gather + reduce - backward_s) + reduce
    return s.micro_batches * (forward + backward_accumulating) + backward_reducing - backward_accumulating


def zero_bubble_h1(pp: int, microbatch_s: float, weight_grad_s: float) -> float:
    """ZB-H1's bubble (Qi et al. 2023, arXiv 2401.10241, §3): the backward split into input gradients (B)
    and weight gradients (W), W deferred into the slots 1F1B leaves idle, so the bubble is
    (p − 1)(T_F + T_B − T_W) where 1F1B's is (p − 1)(T_F + T_B + T_W), at 1F1B's peak activation memory.
    `microbatch_s` = T_F + T_B + T_W of one micro-batch on the busiest stage, `weight_grad_s` = its T_W:
    the projections' and the LM head's weight-gradient GEMMs."""
    return (pp - 1) * max(0.0, microbatch_s - 2 * weight_grad_s)


def step_time(arch: Arch, hw: Hardware, s: StepSetup, params_local: float) -> StepTime:
    """Predicted time of one optimizer step on the slowest device. `params_local`: parameters this
    device holds before data-parallel sharding (its pipeline stage ÷ TP)."""
    dtype = compute_dtype(hw, s.precision)
    bw = hw.achievable_bandwidth()
    layers = -(-arch.n_layers // s.pp)  # the busiest stage
    layer = layer_seconds(arch, hw, s)
    tokens = s.tokens
    head_flops = 3 * 2 * tokens * arch.vocab_size * arch.dim / s.tp  # last stage: logits fwd + bwd
    mb_flops = layers * layer["flops"] + head_flops
    mb_compute = layers * layer["gemm"] + head_flops / hw.gemm_rate(dtype, arch.dim)
    mb_elem = layers * layer["elementwise"] + model_elementwise_bytes(arch, s) / hw.elementwise_rate()
    per_layer = LLAMA_COMPILED_KERNELS_PER_LAYER if s.compiled else 3 * OPS_PER_LAYER[arch.family]
    ops = per_layer * layers + 20
    dispatch = ops * hw.op_overhead_s
    if hw.kind == "gpu":  # launches overlap running kernels: only what exceeds the GPU work shows
        dispatch = max(0.0, dispatch - (mb_compute + mb_elem))
    mb_tp = layers * layer["tp"]
    mb_pp = 0.0
    if s.pp > 1:  # activations forward, their gradients backward, per stage boundary (not overlapped)
        pp_link = hw.link(s.tp * s.pp)
        # Each TP rank sends only its 1/t slice across stages (sequence-parallel shards, or Megatron's
        # scatter/gather optimization: the slices are re-gathered over the fast intra-node link).
        act = tokens * arch.dim * ACT_BYTES[s.precision] / s.tp
        mb_pp = 2 * s.virtual_stages * (act / (pp_link.bandwidth * pp_link.efficiency) + pp_link.latency)
    mb = mb_compute + mb_elem + dispatch + mb_tp + mb_pp
    m = s.micro_batches
    if s.schedule == "zb-h1":  # the weight gradients (W) of later micro-batches fill the bubble
        weight_grad = layers * layer["weight_grad"] + head_flops / 3 / hw.gemm_rate(dtype, arch.dim)
        bubble = zero_bubble_h1(s.pp, mb, weight_grad)
    else:
        bubble = (s.pp - 1) / s.virtual_stages * mb
    if hw.kind == "cpu":  # CPU collectives run on the cores that compute: nothing is hidden
        dp_exposed = data_parallel_seconds(hw, s, params_local, layers)
    elif s.zero == 3:
        layer_s = layer["gemm"] + layer["elementwise"] + layer["tp"] + dispatch / layers
        forward_s = layer_s * layer["forward_flops"] / layer["flops"]
        dp_exposed = zero3_exposed_seconds(hw, s, params_local / layers, layers, forward_s, layer_s - forward_s)
    else:  # DDP / ZeRO-1/2: gradient buckets reduce during the last micro-batch's backward (2/3 of it)
        dp_exposed = max(0.0, data_parallel_seconds(hw, s, params_local, layers) - mb * 2 / 3)
    shard = s.dp_shard if s.zero >= 1 else 1
    adam_bytes = ADAM_BYTES_PER_PARAM[s.precision] if s.master_weights else NO_MASTER_ADAM_BYTES_PER_PARAM
    optimizer = adam_bytes * params_local / shard / bw
    if s.fp8_all_gather:  # torchao's precomputed scales: one amax over every fp32 weight shard per step
        optimizer += 4 * params_local / shard / bw
    if hw.kind == "cpu":  # the per-tensor AdamW kernel and gradient clipping: operators per tensor
        optimizer += OPTIMIZER_OPS_PER_TENSOR * param_tensors(arch, layers) * hw.op_overhead_s
    return StepTime(compute_s=m * mb_compute, elementwise_s=m * mb_elem, dispatch_s=m * dispatch, tp_comm_s=m * mb_tp,
                    pp_comm_s=m * mb_pp, bubble_s=bubble, dp_comm_s=dp_exposed, optimizer_s=optimizer,
                    hardware_flops=m * mb_flops)
