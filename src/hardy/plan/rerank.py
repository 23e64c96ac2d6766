"""`hardy plan serve --workload rerank`: latency, queries/s and cost of query-likelihood re-ranking
(hardy.infer.rerank): each query scores K candidates, each a row of passage + template + query
tokens, in forward passes of up to `rerank_batch` rows; the LM head runs only where a query token
is predicted. The same roofline as generation (plan/serve.py): a pass takes the longer of its FLOPs
at the achievable FLOP/s and its weight bytes at the achievable bandwidth, plus the host's
per-operator cost and the tensor-parallel all-reduces. Formulas: docs/planner-serve.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hardy.errors import HardyError
from hardy.model.config import ModelConfig
from hardy.plan.hardware import Hardware
from hardy.plan.serve import FILE, RESERVE, _gb, _ms, _quant, compute_dtype_for, dispatch_s, shard, stored_weights
from hardy.plan.timing import OPS_PER_LAYER, ring_allreduce
from hardy.plan.weights import WeightLayout

# hardy's default prompt around a passage (infer/rerank.py DEFAULT_TEMPLATE) is ~15 tokens in
# SmolLM2's vocabulary; a "Title — Section" query of the bundled collection ~10 on average.
TEMPLATE_TOKENS = 16
QUERY_TOKENS = 12
# Elements each token reads and writes per layer outside the matmuls and attention in hardy's
# forward (model/transformer.py), by the width they scale with: two RMSNorms and two residual adds (h),
# SiLU(gate) · up (ffn), rotary embedding of q and k (its halves' negation, concatenation, two
# products and a sum).
FORWARD_ELEMENTS = {"h": 10, "f": 5, "q": 8, "kv": 8}


def forward_elements_per_token(model: ModelConfig, devices: int = 1) -> float:
    """Elements one token reads and writes per layer on one device outside the matmuls and attention
    (FORWARD_ELEMENTS; the norms and residuals are replicated under tensor parallelism)."""
    s, e = shard(model, devices), FORWARD_ELEMENTS
    return (e["h"] * model.dim + e["f"] * math.ceil(model.ffn_dim / devices) + e["q"] * s.q_heads * model.d_head
            + e["kv"] * s.kv_heads * model.d_head)


@dataclass
class RerankPlan:
    model: str
    hardware: str
    devices: int
    quant: str
    compute_dtype: str
    candidates: int
    passage_tokens: int
    query_tokens: int
    template_tokens: int
    row_tokens: int
    rerank_batch: int
    passes_per_query: int
    weight_bytes_per_device: float
    activation_bytes_per_device: float
    memory_per_device: float
    usable_memory_per_device: float
    flops_per_query_per_device: float
    bytes_per_query_per_device: float
    compute_s: float  # matmuls + attention + elementwise operators, one after another
    attention_s: float
    elementwise_s: float
    memory_s: float
    dispatch_s: float
    allreduce_s: float
    latency_s: float  # per query on an idle server (first stage not included: ~1 ms for BM25 here)
    bound: str
    queries_per_s: float
    cost_per_hour: float | None
    cost_per_million_queries: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        cost = ("n/a (no price)" if self.cost_per_million_queries is None
                else f"${self.cost_per_million_queries:,.2f} (at ${self.cost_per_hour:,.2f}/hour)")
        rows = [
            ("model / hardware", f"{self.model} on {self.devices} × {self.hardware}"),
            ("weights / compute dtype", f"{self.quant} / {self.compute_dtype}"),
            ("workload", f"re-rank {self.candidates} candidates per query: rows of {self.passage_tokens} passage + "
                         f"{self.template_tokens} template + {self.query_tokens} query = {self.row_tokens} tokens, "
                         f"{self.rerank_batch} rows per pass ({self.passes_per_query} per query)"),
            ("memory per device", f"{_gb(self.memory_per_device)} of {_gb(self.usable_memory_per_device)} usable "
                                  f"(weights {_gb(self.weight_bytes_per_device)}, activations of a pass "
                                  f"{_gb(self.activation_bytes_per_device)})"),
            ("work per query per device", f"{self.flops_per_query_per_device / 1e9:,.1f} GFLOP, "
                                          f"{_gb(self.bytes_per_query_per_device)} of weights read"),
            ("latency per query", f"{_ms(self.latency_s)}, {self.bound}-bound (compute {_ms(self.compute_s)} of which "
                                  f"attention {_ms(self.attention_s)}, elementwise {_ms(self.elementwise_s)}; "
                                  f"memory {_ms(self.memory_s)}, dispatch {_ms(self.dispatch_s)}"
                                  + (f", all-reduce {_ms(self.allreduce_s)})" if self.devices > 1 else ")")),
            ("queries/s", f"{self.queries_per_s:,.3g}"),
            ("cost per 1M queries", cost),
        ]
        return rows + [("note", n) for n in self.notes]


def plan_rerank(model: ModelConfig, hw: Hardware, devices: int = 1, quant: str = "fp16", candidates: int = 20,
                passage_tokens: int = 128, query_tokens: int = QUERY_TOKENS,
                template_tokens: int = TEMPLATE_TOKENS, rerank_batch: int = 20,
                layout: WeightLayout | None = None) -> RerankPlan:
    if (quant == FILE) != (layout is not None):
        raise HardyError("--quant file plans a quantized .gguf file as hardy loads it (give the file as --model)")
    if layout is None:
        quant = _quant(quant)
    for name, value in (("--candidates", candidates), ("--passage-tokens", passage_tokens),
                        ("--query-tokens", query_tokens), ("--rerank-batch", rerank_batch)):
        if value < 1:
            raise HardyError(f"{name} must be >= 1 (got {value})")
    if template_tokens < 0:
        raise HardyError(f"--template-tokens must be >= 0 (got {template_tokens})")
    n = passage_tokens + template_tokens + query_tokens
    if n > model.max_seq_len:
        raise HardyError(f"a candidate row of {n} tokens exceeds {model.name}'s context of {model.max_seq_len}")
    s = shard(model, devices)
    _, w_dev, _, w_read, _, _ = stored_weights(model, devices, quant, layout)
    compute = compute_dtype_for("fp32" if layout is not None and not hw.fast_bf16 else quant, hw)
    act_bytes = 4 if compute == "fp32" else 2
    rows_per_pass = min(rerank_batch, candidates)
    passes = math.ceil(candidates / rows_per_pass)
    L, dh = model.n_layers, model.d_head
    vocab_dev = math.ceil(model.vocab_size / devices)

    # Every row's tokens through the matmuls, causal attention over n(n+1)/2 pairs per head, and the
    # LM head at the query's positions only; the weights are read once per pass.
    # Each at its own measured rate where a probe has one: the matmuls at the model width's inference
    # GEMM rate, attention at the head size's (a CPU's fused kernel runs far below its GEMMs), the
    # elementwise operators at the streaming bandwidth.
    matmul_flops = candidates * (2 * s.matmul * n + 2 * s.head * query_tokens)
    attention_flops = candidates * 4 * L * s.q_heads * dh * n * (n + 1) / 2
    flops = matmul_flops + attention_flops
    elementwise_bytes = candidates * n * L * act_bytes * forward_elements_per_token(model, devices)
    attention_s = attention_flops / hw.attention_rate(compute, dh)
    elementwise_s = elementwise_bytes / hw.elementwise_rate()
    compute_s = matmul_flops / hw.gemm_rate(compute, model.dim, forward=True) + attention_s + elementwise_s
    nbytes = passes * w_read
    memory_s = nbytes / hw.achievable_bandwidth()
    roof = max(compute_s, memory_s)
    ops = (OPS_PER_LAYER["llama"] * L + 20) * passes
    disp = dispatch_s(hw, ops, roof)
    comm = passes * 2 * L * ring_allreduce(rows_per_pass * n * model.dim * act_bytes, devices, hw.link(devices))
    latency = roof + disp + comm
    # A pass's largest live activations: the FFN's two intermediates and the residual stream of every
    # row, and the fp32 log-probabilities of the query positions over the vocabulary.
    activations = (rows_per_pass * n * (2 * math.ceil(model.ffn_dim / devices) + 2 * model.dim) * act_bytes
                   + rows_per_pass * query_tokens * vocab_dev * 4)
    usable = hw.memory_bytes * (1 - RESERVE)
    if w_dev + activations > usable:
        raise HardyError(f"{model.name} re-ranking does not fit on {devices} × {hw.name}: {_gb(w_dev + activations)} "
                         f"per device > {_gb(usable)} usable; lower --rerank-batch or add --devices")
    price = None if hw.price_per_device_hour is None else hw.price_per_device_hour * devices
    notes = []
    if quant in ("int8", "int4") or layout is not None:
        notes.append("quantized weights are dequantized slab by slab for these passes (hardy's prefill path): "
                     f"the matmuls run in {compute}, so weight bytes matter only where a pass is memory-bound")
    return RerankPlan(
        model=model.name, hardware=hw.name, devices=devices, quant=quant, compute_dtype=compute, candidates=candidates,
        passage_tokens=passage_tokens, query_tokens=query_tokens, template_tokens=template_tokens, row_tokens=n,
        rerank_batch=rows_per_pass, passes_per_query=passes, weight_bytes_per_device=w_dev,
        activation_bytes_per_device=activations, memory_per_device=w_dev + activations, usable_memory_per_device=usable,
        flops_per_query_per_device=flops, bytes_per_query_per_device=nbytes, compute_s=compute_s,
        attention_s=attention_s, elementwise_s=elementwise_s, memory_s=memory_s,
        dispatch_s=disp, allreduce_s=comm, latency_s=latency,
        bound=max((compute_s, "compute"), (memory_s, "memory bandwidth"), (disp, "dispatch"))[1],
        queries_per_s=1 / latency, cost_per_hour=price,
        cost_per_million_queries=None if price is None else price / 3600 * latency * 1e6, notes=notes)
