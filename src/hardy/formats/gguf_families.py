"""GGUF metadata <-> ModelConfig for llama.cpp's architecture names (`llama`, `qwen2`, `qwen3`, `gemma2`,
`gemma3`, `qwen2moe`, `qwen3moe`; Mixtral is `llama` with experts): which keys each reads and what llama.cpp fixes in code rather than in the file (Gemma's
layer pattern, local RoPE base and query scale), so that a file means the same model in both.

llama.cpp runs `llama` with interleaved rotary pairs (its converter permutes the q/k rows of
Hugging Face checkpoints into that order) and the others with rotate-half, as hardy does: only
`llama` files have their q/k rows un-permuted on load and permuted on export. Gemma files store
(1 + w) norm weights, which is what the model holds: no conversion.
"""
from __future__ import annotations

import math

import gguf

from hardy.errors import HardyError
from hardy.model.config import ModelConfig, MoEConfig, RopeScaling

# GGUF architecture -> hardy family (a `llama` file with a sliding window is hardy's Mistral export)
ARCH_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text",
               "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
FAMILY_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# Mixture-of-experts architectures (a `llama` file with an expert count is Mixtral). llama.cpp renormalizes
# the chosen experts' weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE, and runs experts in every layer.
MOE_ARCHS = ("qwen2moe", "qwen3moe")
NORMALIZED_TOPK = ("llama", "qwen3moe")
PERMUTED_QK = ("llama",)  # architectures whose q/k rows are in llama.cpp's interleaved rotary order
# Gemma's global layers: every 6th (Gemma 3) / 2nd (Gemma 2); llama.cpp hard-codes these patterns
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_LOCAL_THETA = 10000.0
# llama.cpp scales Gemma's queries by 1/sqrt(head size), except the 27B models (62 / 46 layers), whose
# query_pre_attn_scalar is hidden / heads
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def check_arch(arch, path) -> str:
    if arch not in ARCH_FAMILY:
        raise HardyError(f"{path}: unsupported GGUF architecture {arch!r} (hardy supports: {', '.join(ARCH_FAMILY)})")
    return arch


def config_from_gguf(fields: dict, path, name: str = "custom", tensor_names=()) -> ModelConfig:
    """The model a GGUF file describes; `tensor_names`: the file's tensors (optional biases)."""
    arch = check_arch(fields.get("general.architecture"), path)

    def get(key, default=None):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise HardyError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    try:
        return _config(fields, arch, get, name, set(tensor_names))
    except HardyError as e:  # the config's own checks: say which file
        raise HardyError(f"{path}: {e}") from None
    except (TypeError, ValueError, ArithmeticError) as e:  # a value of the wrong type (a string for a count ...)
        raise HardyError(f"{path}: bad model metadata ({e})") from None


def _rope_scaling(fields: dict, arch: str, get) -> RopeScaling | None:
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        return RopeScaling(factor=float(get("rope.scaling.factor")), kind="linear")
    if kind == "llama3" or (kind in (None, "none") and fields.get(f"{arch}.rope.scaling.factor")):
        return RopeScaling(
            factor=float(get("rope.scaling.factor")),
            low_freq_factor=float(fields.get(f"{arch}.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(fields.get(f"{arch}.rope.scaling.high_freq_factor", 4.0)),
            original_max_position=int(fields.get(f"{arch}.rope.scaling.original_context_length", 8192)))
    if kind not in (None, "none"):
        raise HardyError(f"RoPE scaling {kind!r} is not supported (hardy: linear, llama3)")
    return None


def _config(fields: dict, arch: str, get, name: str, tensors: set) -> ModelConfig:
    n_heads = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    n_layers = int(get("block_count"))
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or [])
    moe = _moe(fields, arch, get)
    ffn = int(get("feed_forward_length")) if moe is None or arch == "llama" else \
        int(fields.get(f"{arch}.feed_forward_length") or moe.ffn_dim)  # the MoE files' dense width goes unused
    head_dim = fields.get(f"{arch}.attention.key_length") or fields.get(f"{arch}.rope.dimension_count")
    head_dim = int(head_dim) if head_dim else dim // n_heads
    window = fields.get(f"{arch}.attention.sliding_window")
    kw = dict(
        vocab_size=int(vocab), dim=dim, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)), ffn_dim=ffn, moe=moe,
        head_dim=head_dim if head_dim != dim // n_heads else None,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(fields, arch, get),
        max_seq_len=int(get("context_length", 2048)), tie_embeddings=False, name=name, family=ARCH_FAMILY[arch],
        attn_bias=arch in ("qwen2", "qwen2moe") or "blk.0.attn_q.bias" in tensors,
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"))
    if window is not None and int(window) < 0:
        raise HardyError(f"{arch}.attention.sliding_window = {window} is negative")
    if arch in SWA_PATTERN:
        # llama.cpp: Gemma 2 always has its window (4096 unless the file says); Gemma 3 only where the file
        # gives one above 0 (else every layer is global)
        window = int(window or 4096) if arch == "gemma2" else int(window or 0) or None
        big = n_layers == GEMMA_27B_LAYERS[arch]
        cap = fields.get(f"{arch}.attn_logit_softcapping")
        kw.update(sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=math.sqrt(dim),
                  attn_scale=(dim / n_heads if big else head_dim) ** -0.5, sliding_window=window,
                  layer_types=tuple("full" if window is None or (i + 1) % SWA_PATTERN[arch] == 0 else "sliding"
                                    for i in range(n_layers)),
                  logit_softcap=fields.get(f"{arch}.final_logit_softcapping"),
                  attn_softcap=float(cap) if cap and arch == "gemma2" else None)  # llama.cpp caps only Gemma 2's
        if arch == "gemma3":
            kw["rope_local_theta"] = float(fields.get("gemma3.rope.freq_base_swa", GEMMA_LOCAL_THETA))
    elif window and arch == "llama" and moe is None:  # llama.cpp ignores it; hardy's own Mistral export writes it
        kw.update(family="mistral", sliding_window=int(window), layer_types=("sliding",) * n_layers)
    if arch == "llama" and moe is not None:
        kw["family"] = "mixtral"
    return ModelConfig(**kw)


def _moe(fields: dict, arch: str, get) -> MoEConfig | None:
    n_experts = fields.get(f"{arch}.expert_count")
    if arch not in MOE_ARCHS and not n_experts:
        return None
    n_experts = int(get("expert_count"))
    if arch == "llama":
        width = int(get("feed_forward_length"))
    else:
        width = int(get("expert_feed_forward_length"))
    shared = int(fields.get(f"{arch}.expert_shared_feed_forward_length") or 0) if arch == "qwen2moe" else 0
    return MoEConfig(n_experts=n_experts, top_k=int(get("expert_used_count")), ffn_dim=width,
                     norm_topk_prob=arch in NORMALIZED_TOPK, shared_ffn_dim=shared, shared_gate=bool(shared))


def write_metadata(writer, cfg: ModelConfig, qtype) -> None:
    """The model's keys under its architecture (the writer was made with `gguf_arch(cfg)`)."""
    arch = gguf_arch(cfg)
    writer.add_name(cfg.name)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_dimension_count(cfg.d_head)
    writer.add_key_length(cfg.d_head)
    writer.add_value_length(cfg.d_head)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(qtype)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling.factor)
    if cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
    if cfg.logit_softcap is not None:
        writer.add_final_logit_softcapping(cfg.logit_softcap)
    if cfg.attn_softcap is not None:
        writer.add_attn_logit_softcapping(cfg.attn_softcap)
    if arch == "gemma3" and cfg.rope_local_theta is not None:
        writer.add_rope_freq_base_swa(cfg.rope_local_theta)
    if cfg.moe is not None:
        writer.add_expert_count(cfg.moe.n_experts)
        writer.add_expert_used_count(cfg.moe.top_k)
        if arch != "llama":
            writer.add_expert_feed_forward_length(cfg.moe.ffn_dim)
        if cfg.moe.shared_ffn_dim:
            writer.add_expert_shared_feed_forward_length(cfg.moe.shared_ffn_dim)


def gguf_arch(cfg: ModelConfig) -> str:
    """The llama.cpp architecture a model is written as; refused where llama.cpp would run another model."""
    arch = FAMILY_ARCH.get(cfg.family)
    if arch is None:
        raise HardyError(f"GGUF export of the {cfg.family!r} family is not supported")
    back = _config_of_written(cfg, arch)
    differs = [k for k in ("qk_norm", "sandwich_norms", "mlp_act", "embed_scale", "attn_scale", "attn_softcap",
                           "logit_softcap", "layer_types", "sliding_window", "rope_local_theta", "attn_bias",
                           "moe")
               if getattr(back, k) != getattr(cfg, k)]
    if differs:
        raise HardyError(f"the model's {', '.join(differs)} cannot be written as a GGUF {arch!r} file "
                         "(llama.cpp would run a different model)")
    return arch


def _config_of_written(cfg: ModelConfig, arch: str) -> ModelConfig:
    """What a loader would read back from the metadata `write_metadata` writes for `cfg`."""
    fields = {"general.architecture": arch, f"{arch}.attention.head_count": cfg.n_heads,
              f"{arch}.embedding_length": cfg.dim, f"{arch}.block_count": cfg.n_layers,
              f"{arch}.feed_forward_length": cfg.ffn_dim, f"{arch}.attention.key_length": cfg.d_head,
              f"{arch}.vocab_size": cfg.vocab_size, f"{arch}.context_length": cfg.max_seq_len,
              f"{arch}.rope.freq_base": cfg.rope_theta, f"{arch}.attention.sliding_window": cfg.sliding_window,
              f"{arch}.final_logit_softcapping": cfg.logit_softcap,
              f"{arch}.attn_logit_softcapping": cfg.attn_softcap}
    if cfg.rope_local_theta is not None:
        fields[f"{arch}.rope.freq_base_swa"] = cfg.rope_local_theta
    if cfg.moe is not None:
        fields.update({f"{arch}.expert_count": cfg.moe.n_experts, f"{arch}.expert_used_count": cfg.moe.top_k,
                       f"{arch}.expert_feed_forward_length": cfg.moe.ffn_dim,
                       f"{arch}.expert_shared_feed_forward_length": cfg.moe.shared_ffn_dim})
    tensors = {"blk.0.attn_q.bias"} if cfg.attn_bias else set()
    return _config(fields, arch, lambda key, default=None: fields.get(f"{arch}.{key}", default), cfg.name, tensors)
