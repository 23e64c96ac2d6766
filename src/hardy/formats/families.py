"""Model families as file mappings: how a Hugging Face `config.json` (its `model_type`) becomes the one
`ModelConfig` every family is a setting of, and back. The block's options are the model's
(`hardy.model.config`); which keys set them, and what a family cannot express, lives here. The GGUF
side (llama.cpp's architecture names and metadata keys) is `hardy.formats.gguf_families`.

Where the families' files differ from the model's own numbers:
  - Gemma's RMSNorm multiplies by (1 + w) and its files store w: the model holds 1 + w (as llama.cpp's
    GGUF files do), so reading adds 1 and writing subtracts it (`HFNames`).
  - Gemma names its four block norms input / post_attention / pre_feedforward / post_feedforward, where
    Llama's `post_attention_layernorm` is the norm *before* the MLP (`hardy.formats.names`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hardy.errors import HardyError
from hardy.formats.names import from_format, to_format
from hardy.model.config import ModelConfig, MoEConfig, RopeScaling


@dataclass(frozen=True)
class Family:
    name: str  # hardy's family name: the Hugging Face model_type
    hf_class: str  # the transformers class a directory of this family names
    norm_offset: float = 0.0  # the files store w where the model multiplies by (offset + w)
    base: str | None = None  # a mixture-of-experts family: the dense family its attention and keys follow
    moe: str | None = None  # its experts' tensor naming (hardy.formats.names.HF_MOE)

    @property
    def dense(self) -> str:
        return self.base or self.name


FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM"),
    Family("qwen2", "Qwen2ForCausalLM"),
    Family("qwen3", "Qwen3ForCausalLM"),
    Family("gemma2", "Gemma2ForCausalLM", norm_offset=1.0),
    Family("gemma3_text", "Gemma3ForCausalLM", norm_offset=1.0),
    Family("mixtral", "MixtralForCausalLM", base="mistral", moe="mixtral"),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", base="qwen2", moe="qwen"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", base="qwen3", moe="qwen"),
)}
# Gemma 3's multimodal checkpoints (4B and up) hold the same text model under a `text_config`.
MULTIMODAL = {"gemma3": "gemma3_text"}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise HardyError(f"unsupported model family {name!r} (hardy supports: {', '.join(FAMILIES)})") from None


class HFNames:
    """hardy parameter names <-> a family's Hugging Face tensor names, and the values' conventions."""

    def __init__(self, cfg: ModelConfig | None = None):  # None: Llama's
        self.sandwich = cfg is not None and cfg.sandwich_norms
        fam = FAMILIES.get(cfg.family) if cfg is not None else None
        self.offset = fam.norm_offset if fam else 0.0
        self.moe = fam.moe if fam else None

    def to_hf(self, name: str) -> str:
        return to_format(name, "hf", sandwich=self.sandwich, moe=self.moe)

    def from_hf(self, key: str) -> str | None:
        return from_format(key, "hf", sandwich=self.sandwich, moe=self.moe)

    def _is_norm(self, name: str) -> bool:
        return self.offset != 0.0 and name.endswith("norm.weight")

    def read(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A tensor as stored in the file -> the model's value (norms in fp32: 1 + w of a bf16 w is not
        a bf16 number)."""
        return t.float() + self.offset if self._is_norm(name) else t

    def write(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.float() - self.offset if self._is_norm(name) else t


# --- Hugging Face config.json -> ModelConfig ---------------------------------------------------------

INT_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "head_dim", "max_position_embeddings", "sliding_window", "num_local_experts",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
            "decoder_sparse_step")
FLOAT_KEYS = ("rms_norm_eps", "rope_theta", "query_pre_attn_scalar", "final_logit_softcapping",
              "attn_logit_softcapping", "rope_local_base_freq")


def check_types(data: dict, path) -> None:
    """A string or a float where a count belongs would fail far from here."""
    for key in INT_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise HardyError(f"{path}: config.json {key} = {value!r} is not an integer")
    for key in FLOAT_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise HardyError(f"{path}: config.json {key} = {value!r} is not a number")


def rope_settings(params: dict, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(base, scaling) from one RoPE parameter set (transformers' `rope_parameters`, or the older
    `rope_scaling` with `rope_theta` beside it)."""
    theta = float(params.get("rope_theta") or default_theta)
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(factor=float(params["factor"]), kind="linear")
    if kind == "llama3":
        return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_position=int(params["original_max_position_embeddings"]))
    raise HardyError(f"RoPE scaling {kind!r} is not supported (hardy: default, linear, llama3)")


def _rope(data: dict, default_theta: float = 10000.0) -> tuple[float, RopeScaling | None]:
    params = data.get("rope_parameters")
    if not isinstance(params, dict) or "full_attention" in params:
        params = {**(data.get("rope_scaling") or {}), "rope_theta": data.get("rope_theta")}
    return rope_settings(params, default_theta)


def _layer_types(data: dict, n_layers: int) -> tuple[str, ...]:
    types = data.get("layer_types")
    if types is None:
        return ()
    if not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise HardyError(f"layer_types must list full_attention / sliding_attention per layer (got {types!r})")
    if len(types) != n_layers:
        raise HardyError(f"layer_types lists {len(types)} layers, num_hidden_layers is {n_layers}")
    return tuple("sliding" if t == "sliding_attention" else "full" for t in types)


def _common(data: dict) -> dict:
    n_heads, dim = data["num_attention_heads"], data["hidden_size"]
    head_dim = data.get("head_dim")
    return dict(
        vocab_size=data["vocab_size"], dim=dim, n_layers=data["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=data.get("num_key_value_heads") or n_heads, ffn_dim=data["intermediate_size"],
        head_dim=head_dim if head_dim and head_dim != dim // n_heads else None,
        norm_eps=float(data.get("rms_norm_eps") or 1e-6), max_seq_len=data.get("max_position_embeddings") or 2048,
        tie_embeddings=bool(data.get("tie_word_embeddings", False)), name=str(data.get("hardy_preset", "custom")))


def _act(data: dict, key: str, expected: str) -> None:
    value = data.get(key)
    if value is not None and value != expected:
        raise HardyError(f"{key} {value!r} is not supported for model_type {data.get('model_type')!r} "
                         f"(expected {expected!r})")


def _llama_like(data: dict, family_name: str) -> ModelConfig:
    _act(data, "hidden_act", "silu")
    if data.get("mlp_bias"):
        raise HardyError("mlp_bias = true is not supported")
    if family_name == "llama" and data.get("attention_bias"):
        raise HardyError("attention_bias = true (a bias on every attention projection) is not supported")
    theta, scaling = _rope(data)
    kw = _common(data)
    window, types = data.get("sliding_window"), _layer_types(data, kw["n_layers"])
    if family_name == "mistral" and window:
        types = types or ("sliding",) * kw["n_layers"]  # Mistral's window covers every layer
    elif family_name in ("qwen2", "qwen3"):
        if not data.get("use_sliding_window"):
            window, types = None, ()  # written in every Qwen config, used by none of the released ones
        elif not types:
            first = data.get("max_window_layers", kw["n_layers"])
            types = tuple("sliding" if i >= first else "full" for i in range(kw["n_layers"]))
    if "sliding" not in types:
        window, types = None, ()
    return ModelConfig(**kw, rope_theta=theta, rope_scaling=scaling, family=family_name,
                       attn_bias=family_name == "qwen2" or bool(data.get("attention_bias", False)),
                       qk_norm=family_name == "qwen3", sliding_window=window, layer_types=types)


def _moe(data: dict, family_name: str, n_layers: int) -> MoEConfig:
    """The experts of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    if family_name == "mixtral":
        return MoEConfig(n_experts=data["num_local_experts"], top_k=data["num_experts_per_tok"],
                         ffn_dim=data["intermediate_size"], norm_topk_prob=True)
    only = data.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise HardyError(f"mlp_only_layers must list layer indices (got {only!r})")
    step = data.get("decoder_sparse_step") or 1
    if step <= 0:
        raise HardyError(f"decoder_sparse_step must be positive (got {step})")
    dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    shared = data.get("shared_expert_intermediate_size") or 0 if family_name == "qwen2_moe" else 0
    n_experts = data["num_experts"] if "num_experts" in data else data["num_local_experts"]  # transformers 5 writes the latter
    return MoEConfig(n_experts=n_experts, top_k=data["num_experts_per_tok"],
                     ffn_dim=data["moe_intermediate_size"], norm_topk_prob=bool(data.get("norm_topk_prob", False)),
                     shared_ffn_dim=shared, shared_gate=bool(shared), dense_layers=dense)


def _gemma(data: dict, family_name: str) -> ModelConfig:
    act = data.get("hidden_activation") or data.get("hidden_act")
    if act not in (None, "gelu_pytorch_tanh", "gelu_tanh"):
        raise HardyError(f"hidden_activation {act!r} is not supported for Gemma (expected gelu_pytorch_tanh)")
    kw = _common({**data, "tie_word_embeddings": data.get("tie_word_embeddings", True)})
    n = kw["n_layers"]
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        theta, scaling = rope_settings(params["full_attention"] or {}, 1e6 if family_name == "gemma3_text" else 1e4)
        local = float((params.get("sliding_attention") or {}).get("rope_theta") or 1e4)
    else:
        theta, scaling = _rope(data, 1e6 if family_name == "gemma3_text" else 1e4)
        local = float(data.get("rope_local_base_freq") or 1e4)
    pattern = 6 if family_name == "gemma3_text" else 2  # every 6th (Gemma 3) / 2nd (Gemma 2) layer is global
    types = _layer_types(data, n) or tuple("full" if (i + 1) % data.get("sliding_window_pattern", pattern) == 0
                                           else "sliding" for i in range(n))
    head_dim = kw["head_dim"] or kw["dim"] // kw["n_heads"]
    scalar = data.get("query_pre_attn_scalar") or head_dim
    return ModelConfig(
        **kw, rope_theta=theta, rope_scaling=scaling, family=family_name, qk_norm=family_name == "gemma3_text",
        sandwich_norms=True, mlp_act="gelu_tanh", embed_scale=math.sqrt(kw["dim"]), attn_scale=float(scalar) ** -0.5,
        attn_softcap=data.get("attn_logit_softcapping"), logit_softcap=data.get("final_logit_softcapping"),
        sliding_window=data.get("sliding_window") or 4096, layer_types=types,
        rope_local_theta=local if family_name == "gemma3_text" else None)


def config_from_hf(data: dict, path) -> ModelConfig:
    if not isinstance(data, dict):
        raise HardyError(f"{path}: config.json must hold a JSON object")
    model_type = data.get("model_type")
    if model_type is None:
        raise HardyError(f"{path}: config.json lacks model_type")
    if not isinstance(model_type, str):
        raise HardyError(f"{path}: config.json's model_type must be a string (got {model_type!r})")
    if model_type in MULTIMODAL:
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise HardyError(f"{path}: config.json of model_type {model_type!r} lacks its text_config")
        data = {**text, "model_type": MULTIMODAL[model_type],
                "tie_word_embeddings": data.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}
        model_type = data["model_type"]
    if model_type not in FAMILIES:
        raise HardyError(f"{path}: unsupported model_type {model_type!r} (hardy supports: "
                         f"{', '.join([*FAMILIES, *MULTIMODAL])})")
    check_types(data, path)
    try:
        if model_type.startswith("gemma"):
            return _gemma(data, model_type)
        fam = FAMILIES[model_type]
        cfg = _llama_like(data, fam.dense)
        if fam.moe is None:
            return cfg
        bias = bool(data.get("qkv_bias", True)) if model_type == "qwen2_moe" else cfg.attn_bias
        return cfg.replace(family=model_type, moe=_moe(data, model_type, cfg.n_layers), attn_bias=bias)
    except KeyError as e:
        raise HardyError(f"{path}: config.json lacks {e.args[0]}") from None
    except HardyError as e:  # the config's own checks: say which file
        raise HardyError(f"{path}: {e}") from None
    except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
        raise HardyError(f"{path}: bad config.json ({type(e).__name__}: {e})") from None


# --- ModelConfig -> Hugging Face config.json ---------------------------------------------------------

def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling.kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": scaling.factor}
    return {"rope_type": "llama3", "rope_theta": theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}


def _writable(cfg: ModelConfig) -> None:
    """A config whose options its family's files cannot say is refused rather than written wrong."""
    fam = family(cfg.family)
    if (cfg.moe is None) != (fam.moe is None):
        raise HardyError(f"a model {'with' if cfg.moe else 'without'} experts cannot be written as a "
                         f"{cfg.family!r} checkpoint")
    if cfg.moe is not None:
        _moe_writable(cfg, fam)
    bias_free = fam.name == "qwen2_moe"  # its qkv_bias says whether it has them
    cfg = cfg.replace(family=fam.dense, moe=None, attn_bias=cfg.attn_bias if not bias_free else True)
    expected = {"attn_bias": cfg.family == "qwen2", "qk_norm": cfg.family in ("qwen3", "gemma3_text"),
                "sandwich_norms": cfg.family.startswith("gemma"),
                "mlp_act": "gelu_tanh" if cfg.family.startswith("gemma") else "silu"}
    if cfg.family == "qwen3":
        expected["attn_bias"] = cfg.attn_bias  # Qwen3 configs say attention_bias themselves
    wrong = [k for k, v in expected.items() if getattr(cfg, k) != v]
    if not cfg.family.startswith("gemma"):
        wrong += [k for k in ("attn_softcap", "logit_softcap", "rope_local_theta", "attn_scale")
                  if getattr(cfg, k) is not None]
        wrong += ["embed_scale"] if cfg.embed_scale != 1.0 else []
    if cfg.family == "llama" and cfg.sliding_window:
        wrong.append("sliding_window")
    if cfg.family == "mistral" and cfg.layer_types and set(cfg.layer_types) != {"sliding"}:
        wrong.append("layer_types")  # Mistral's window covers every layer or none
    if cfg.family == "gemma2" and cfg.rope_local_theta is not None:
        wrong.append("rope_local_theta")
    if wrong:
        raise HardyError(f"the model's {', '.join(wrong)} cannot be written as a {cfg.family!r} checkpoint")


def _moe_writable(cfg: ModelConfig, fam: Family) -> None:
    m, wrong = cfg.moe, []
    if fam.name == "mixtral" and (not m.norm_topk_prob or m.dense_layers or m.ffn_dim != cfg.ffn_dim):
        wrong.append("dense layers, width or unnormalized routing")
    if (m.shared_ffn_dim > 0) != (fam.name == "qwen2_moe") or m.shared_gate != bool(m.shared_ffn_dim):
        wrong.append("shared expert")
    if wrong:
        raise HardyError(f"the model's experts ({', '.join(wrong)}) cannot be written as a {fam.name!r} checkpoint")


def _moe_keys(cfg: ModelConfig) -> dict:
    m = cfg.moe
    if cfg.family == "mixtral":
        return {"num_local_experts": m.n_experts, "num_experts_per_tok": m.top_k}
    out = {"num_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.ffn_dim,
           "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": list(m.dense_layers)}
    if cfg.family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = m.shared_ffn_dim
    return out


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, dtype: str = "float32") -> dict:
    fam = family(cfg.family)
    _writable(cfg)
    rope = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
    out = {
        "architectures": [fam.hf_class], "model_type": fam.name,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope if cfg.rope_scaling else None, "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
        "torch_dtype": dtype, "hardy_preset": cfg.name,
    }
    types = ["sliding_attention" if k == "sliding" else "full_attention" for k in cfg.kinds]
    if fam.name.startswith("gemma"):
        local = _rope_dict(cfg.rope_local_theta or cfg.rope_theta, None)
        scalar = cfg.attn_scale ** -2 if cfg.attn_scale else cfg.d_head
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False, sliding_window=cfg.sliding_window,
                   layer_types=types, query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                   attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.logit_softcap)
        if fam.name == "gemma3_text":
            out.update(rope_local_base_freq=local["rope_theta"],
                       rope_parameters={"full_attention": rope, "sliding_attention": local})
        return out
    out.update(hidden_act="silu", **(_moe_keys(cfg) if cfg.moe else {}))
    if fam.dense == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif fam.dense == "mistral":
        out.update(sliding_window=cfg.sliding_window)
    else:  # qwen2 / qwen3 and their MoE
        sliding = cfg.sliding_window is not None
        out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window, layer_types=types,
                   max_window_layers=cfg.kinds.index("sliding") if sliding else cfg.n_layers)
        if fam.name == "qwen2_moe":
            out.update(qkv_bias=cfg.attn_bias)
        if fam.dense == "qwen3":
            out.update(attention_bias=cfg.attn_bias)
    return out
