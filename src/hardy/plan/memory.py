"""Training memory per device: model states (ZeRO/FSDP), activations per recompute mode, buffers.

Model states (ZeRO, Rajbhandari et al. 2020): with w, g, o bytes per parameter for weights,
gradients and optimizer states and d data-parallel ranks sharing them,
    ZeRO-0  (w + g + o)·Ψ      ZeRO-1  (w + g)·Ψ + o·Ψ/d
    ZeRO-2  w·Ψ + (g + o)·Ψ/d  ZeRO-3  (w + g + o)·Ψ/d
Mixed precision Adam: w = 2, g = 2, o = 12 (fp32 master, m, v); pure fp32 Adam: 4, 4, 8; without
master weights (pure bf16: weights, gradients, m and v all 16-bit, as KempnerForge trains): 2, 2, 4.

Activations per layer and micro-batch, from what autograd actually keeps:
- GPT-style (Korthikanti et al. 2022): 16-bit s·b·h·(34 + 5·a·s/h); built here from its parts so
  tensor/sequence parallelism, recompute, dropout and the activation dtype are explicit.
- hardy's Llama (SwiGLU, GQA, flash-attention SDPA that keeps no s×s matrix), counted from the
  tensors autograd saves in `model/transformer.py` (checked by `tests/test_plan_train.py`):
  per token, in the activation dtype, 3h per RMSNorm (input, normalized, scaled output) ×2,
  q and the attention output (a·d_h each), k and v (n_kv·d_h each), 4f for the SwiGLU MLP
  (gate, silu(gate), up, their product); plus fp32 per token: two RMSNorm 1/rms and a
  log-sum-exp per head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hardy.errors import HardyError
from hardy.plan.arch import Arch

# bytes per parameter: weights, gradients, optimizer states (AdamW)
STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12)}
NO_MASTER_STATE_BYTES = (2, 2, 4)  # 16-bit weights and gradients, AdamW's m and v in 16 bits too
ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
RECOMPUTE = ("none", "selective", "full", "selective_op")
# A Llama model's loss: "chunked" is hardy's fused linear cross-entropy (no whole logits tensor);
# "full" materializes the logits and takes the cross-entropy over their fp32 copy, as torchtitan
# (`cross_entropy(pred.flatten(0, 1).float(), labels)`) and transformers do; "compiled" is that loss
# torch.compile'd (torchtitan with --compile since 2025): inductor saves the 16-bit logits and two fp32
# values per token, and makes no fp32 copy.
LOSSES = ("chunked", "full", "compiled")


def state_bytes(precision: str, master_weights: bool = True) -> tuple[int, int, int]:
    """Bytes per parameter of weights, gradients and AdamW states; `master_weights` False: a 16-bit run
    that keeps no fp32 copy. fp8 training (`plan train --fp8`) runs its linears in fp8 inside a bf16 model
    and keeps bf16 states: its callers pass "bf16"."""
    if precision not in STATE_BYTES:
        raise HardyError(f"no model-state sizes for precision {precision!r} "
                         f"(known: {', '.join(STATE_BYTES)}; fp8 training keeps bf16 states)")
    return STATE_BYTES[precision] if master_weights or precision == "fp32" else NO_MASTER_STATE_BYTES


def gathered_weight_bytes(precision: str, master_weights: bool = True, fp8_all_gather: bool = False) -> float:
    """Bytes per parameter ZeRO-3 gathers and holds gathered: the run's weights, or 1 under torchao's FSDP
    float8 all-gather, which casts each shard to fp8 before gathering (a layer's norm weights, 0.004% of a
    Llama layer, are counted in fp8 too)."""
    return 1.0 if fp8_all_gather else state_bytes(precision, master_weights)[0]


def model_state_bytes(params: float, zero: int, dp: int, precision: str = "bf16",
                      offload: str = "none", master_weights: bool = True) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer states for `params` parameters held by
    this model-parallel rank, sharded over `dp` ranks by ZeRO stage `zero` (3 = FSDP full shard).

    offload "optimizer" keeps optimizer states (and, as ZeRO-Offload does, fp32 gradients) in host
    memory; "params" also the weights (ZeRO-3 only). Host bytes are returned under "host". DeepSpeed's
    offloading optimizer (stages 1 and 2 alike) keeps each rank's partition of the gradients in fp32 on
    the host for the CPU Adam step: 4 bytes per parameter of the shard (the run's own 16 bits without
    master weights).
    """
    if zero not in (0, 1, 2, 3):
        raise HardyError(f"ZeRO stage must be 0, 1, 2 or 3 (got {zero})")
    if dp < 1:
        raise HardyError(f"model states are sharded over dp >= 1 data-parallel ranks (got dp={dp})")
    if offload not in ("none", "optimizer", "params"):
        raise HardyError(f"offload must be none, optimizer or params (got {offload!r})")
    if offload == "params" and zero != 3:
        raise HardyError("parameter offload needs ZeRO-3 / FSDP full sharding (--zero 3)")
    w, g, o = state_bytes(precision, master_weights)
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[zero]
    weights, grads, optim = w * params / shard[0], g * params / shard[1], o * params / shard[2]
    host = 0.0
    if offload in ("optimizer", "params"):
        # the gradient partition matches the optimizer's; fp32 runs' g is already 4
        host += optim + (4 if master_weights else g) * params / shard[2]
        optim, grads = 0.0, 0.0
    if offload == "params":
        host += weights
        weights = 0.0
    return {"weights": weights, "gradients": grads, "optimizer": optim, "host": host}


@dataclass(frozen=True)
class ActivationSetup:
    seq: int
    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    precision: str = "bf16"
    # A dropout mask is 1 byte on GPUs (fused kernel, bool mask); PyTorch's CPU dropout keeps a mask of
    # the activation dtype (measured: autograd saves it).
    cpu: bool = False
    loss: str = "chunked"  # a Llama model's loss (LOSSES); GPT-style models keep fp32 logits either way
    # Sequence parallelism as Megatron runs it (the linears keep their sharded input and gather it again in
    # the backward) or as DTensor does (torchtitan: each column-parallel linear keeps its all-gathered input)
    sp_style: str = "megatron"

    @property
    def keeps_gathered_inputs(self) -> bool:
        """DTensor's sequence parallelism over several ranks: column-parallel linears keep their gathered input."""
        return self.sequence_parallel and self.tp > 1 and self.sp_style == "dtensor"


def layer_activation_bytes(arch: Arch, a: ActivationSetup, recompute: str | None = None) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one tensor-parallel rank."""
    recompute = a.recompute if recompute is None else recompute
    if recompute not in RECOMPUTE:
        raise HardyError(f"recompute must be one of {', '.join(RECOMPUTE)} (got {recompute!r})")
    tokens, e, t = a.seq * a.micro_batch, ACT_BYTES[a.precision], a.tp
    rep = t if a.sequence_parallel else 1  # what TP alone leaves replicated is split by SP
    if recompute == "full":  # only the layer input is kept
        return tokens * arch.dim * e / rep
    if arch.family == "gpt":
        mask = 1 if arch.dropout else 0
        # replicated under TP: LN1 input, QKV input, LN2 input, MLP input (e each), two dropout masks
        replicated = tokens * arch.dim * (4 * e + 2 * mask)
        # split by TP: Q, K, V, projection input (e·h each), GeLU input and output (e·f each)
        split = tokens * (4 * arch.dim * e + 2 * arch.ffn_dim * e)
        # s×s per head: softmax output (e), dropout mask (1), dropout output (e); a flash kernel keeps
        # only a log-sum-exp per head and token (fp32) and its output (the projection input, above)
        scores = a.micro_batch * arch.n_heads * a.seq * a.seq * ((2 * e + 1) if arch.dropout else e)
        if arch.flash_attention:
            scores = tokens * arch.n_heads * 4
        elif recompute == "selective":
            scores = 0.0
        return replicated / rep + (split + scores) / t
    # residual dropout keeps two masks (CUDA: 1-byte bool; CPU: the activation dtype)
    masks = 2 * arch.dim * (e if a.cpu else 1) if arch.dropout else 0
    if recompute == "selective_op":
        # torchtitan's op-level policy: the block input, the outputs of wq, wv, w1 and w2 (every second
        # matmul) and the attention output with its log-sum-exp; the rest is recomputed in backward
        replicated = tokens * (2 * arch.dim * e + masks)
        split = tokens * ((2 * arch.q_dim + arch.kv_dim + arch.ffn_dim) * e + 4 * arch.n_heads)
        return replicated / rep + split / t
    if recompute == "selective":
        # op level (hardy's policy, PyTorch's selective checkpointing): every matmul output (q, k, v,
        # the attention projection, gate, up, down) and the attention output with its log-sum-exp are
        # kept, with the block input; norms, RoPE, SiLU·up and residual adds are recomputed in backward.
        replicated = tokens * (3 * arch.dim * e + masks)
        split = tokens * ((2 * arch.q_dim + 2 * arch.kv_dim + 2 * arch.ffn_dim) * e + 4 * arch.n_heads)
        return replicated / rep + split / t
    # two RMSNorms (input, normalized, output) + 1/rms
    replicated = tokens * (6 * arch.dim * e + 2 * 4 + masks)
    split = tokens * ((2 * arch.q_dim + 2 * arch.kv_dim + 4 * arch.ffn_dim) * e + 4 * arch.n_heads)
    if a.keeps_gathered_inputs:
        # each norm's output is all-gathered for QKV and for gate/up, which keep the gathered tensor
        gathered = tokens * 2 * arch.dim * e
        return (replicated - gathered) / t + gathered + split / t
    return replicated / rep + split / t


class OutputActivations(NamedTuple):
    kept: float  # for the backward
    transient: float  # during the forward only


def output_activation_bytes(arch: Arch, a: ActivationSetup) -> OutputActivations:
    """Bytes of the LM head and loss, per micro-batch on the last pipeline stage.

    hardy's Llama uses a fused, chunked linear cross-entropy: it keeps d(loss)/d(hidden) (h per
    token) and d(loss)/d(head weight) (fp32, V·h), plus the final RMSNorm's input and normalized
    values (2h) and 1/rms per token: its output is not kept, the loss keeping gradients instead;
    its chunk logits (≤ 2^24 fp32 values, twice: logits and log-softmax) exist only while the loss
    is computed. `loss="full"` (torchtitan's and transformers' loss): the whole logits tensor, its
    fp32 copy and log_softmax's fp32 output instead; `loss="compiled"`: that loss compiled, which keeps
    the 16-bit logits and makes their gradient. GPT-style (Megatron): final LayerNorm input and
    fp32 logits, split by TP, kept.
    """
    tokens, e, t = a.seq * a.micro_batch, ACT_BYTES[a.precision], a.tp
    if arch.family == "gpt":
        return OutputActivations(tokens * arch.dim * e / (t if a.sequence_parallel else 1)
                                 + 4 * tokens * arch.vocab_size / t, 0.0)
    final_norm = tokens * (3 * arch.dim * e + 4) / (t if a.sequence_parallel else 1)
    if a.keeps_gathered_inputs:  # the head keeps its all-gathered input
        final_norm = tokens * (2 * arch.dim * e + 4) / t + tokens * arch.dim * e
    logits = tokens * arch.vocab_size / t  # split by TP's vocabulary-parallel loss
    if a.loss == "full":
        # the backward needs log_softmax's fp32 output (4 B per logit). Transient, beyond it: in the backward
        # nll_loss's fp32 gradient and log_softmax's (8 B), more than the forward's logits and their fp32
        # copy (e + 4 B, e at most 4)
        return OutputActivations(final_norm + 4 * logits, 8 * logits)
    if a.loss == "compiled":  # kept: the logits (and 8 B per token); transient: their gradient
        return OutputActivations(final_norm + e * logits + 8 * tokens / t, e * logits)
    # the loss's chunks (hardy.model.loss): as equal as can be, each at most 2^24 logits
    per_chunk = max(1, (1 << 24) // arch.vocab_size)
    chunk_rows = -(-tokens // -(-tokens // per_chunk))
    kept = tokens * (3 * arch.dim * e + 4) + 4 * arch.vocab_size * arch.dim
    return OutputActivations(kept, 2 * 4 * chunk_rows * arch.vocab_size)
