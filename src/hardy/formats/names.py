"""Tensor-name maps between hardy's state dict, GGUF (llama.cpp) and Hugging Face Llama."""
from __future__ import annotations

import re

from hardy.errors import HardyError
from hardy.model.transformer import meta_transformer

# Per-layer tensors: hardy suffix -> (GGUF suffix, HF suffix, HF suffix in a family with sandwich norms:
# Gemma calls the norm before the MLP `pre_feedforward_layernorm`, and its `post_attention_layernorm`
# is the norm on the attention's output, where Llama's is the norm before the MLP).
LAYER_TENSORS = {
    "attention_norm.weight": ("attn_norm.weight", "input_layernorm.weight", None),
    "attention.wq.weight": ("attn_q.weight", "self_attn.q_proj.weight", None),
    "attention.wk.weight": ("attn_k.weight", "self_attn.k_proj.weight", None),
    "attention.wv.weight": ("attn_v.weight", "self_attn.v_proj.weight", None),
    "attention.wq.bias": ("attn_q.bias", "self_attn.q_proj.bias", None),
    "attention.wk.bias": ("attn_k.bias", "self_attn.k_proj.bias", None),
    "attention.wv.bias": ("attn_v.bias", "self_attn.v_proj.bias", None),
    "attention.q_norm.weight": ("attn_q_norm.weight", "self_attn.q_norm.weight", None),
    "attention.k_norm.weight": ("attn_k_norm.weight", "self_attn.k_norm.weight", None),
    "attention.wo.weight": ("attn_output.weight", "self_attn.o_proj.weight", None),
    "post_attention_norm.weight": ("post_attention_norm.weight", None, "post_attention_layernorm.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight"),
    "feed_forward.w1.weight": ("ffn_gate.weight", "mlp.gate_proj.weight", None),
    "feed_forward.w3.weight": ("ffn_up.weight", "mlp.up_proj.weight", None),
    "feed_forward.w2.weight": ("ffn_down.weight", "mlp.down_proj.weight", None),
    "post_ffn_norm.weight": ("post_ffw_norm.weight", None, "post_feedforward_layernorm.weight"),
}
GLOBAL_TENSORS = {
    "tok_embeddings.weight": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm.weight": ("output_norm.weight", "model.norm.weight"),
    "output.weight": ("output.weight", "lm_head.weight"),
}
_FORMATS = {"gguf": (0, "blk.{}."), "hf": (1, "model.layers.{}.")}
# Multimodal checkpoints keep the text model under a prefix (Gemma 3 4B and up; transformers 4 and 5
# name it differently); their vision tower has no hardy name and is not read.
HF_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."))


# Mixture-of-experts tensors, after `layers.{i}.feed_forward.` in hardy's names. Hugging Face names
# them per family (`HF_MOE`: block prefix, router, expert / shared-expert projections); GGUF stacks
# each projection of all experts in one 3-D tensor (`ffn_gate_exps`: [experts, rows, columns]), which
# hardy names with the expert index as `*` (`experts.*.w1.weight`) and splits on load.
PROJECTIONS = ("w1", "w3", "w2")
HF_MOE = {"mixtral": ("block_sparse_moe.", "gate.weight", ("w1", "w3", "w2"), None),
          "qwen": ("mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj"), "shared_expert")}
GGUF_MOE = {"router.weight": "ffn_gate_inp.weight", "shared_gate.weight": "ffn_gate_inp_shexp.weight",
            **{f"experts.*.{w}.weight": f"ffn_{g}_exps.weight" for w, g in zip(PROJECTIONS, ("gate", "up", "down"))},
            **{f"shared.{w}.weight": f"ffn_{g}_shexp.weight" for w, g in zip(PROJECTIONS, ("gate", "up", "down"))}}
STACKED = re.compile(r"(layers\.\d+\.feed_forward\.experts)\.\*\.(w[123]\.weight)")


def _moe_hf(style: str) -> list[tuple[str, str]]:
    """(hardy regex, HF template) pairs of a style's MoE tensors; the regex's group is the expert."""
    prefix, router, projections, shared = HF_MOE[style]
    pairs = [(r"router\.weight", prefix + router)]
    for ours, theirs in zip(PROJECTIONS, projections):
        pairs.append((rf"experts\.(\d+)\.{ours}\.weight", prefix + "experts.{}." + theirs + ".weight"))
        if shared:
            pairs.append((rf"shared\.{ours}\.weight", f"{prefix}{shared}.{theirs}.weight"))
    if shared:
        pairs.append((r"shared_gate\.weight", f"{prefix}{shared}_gate.weight"))
    return pairs


def _moe_to(rest: str, fmt: str, moe: str | None) -> str | None:
    if fmt == "gguf":
        return GGUF_MOE.get(rest.removeprefix("feed_forward."))
    if moe is None or not rest.startswith("feed_forward."):
        return None
    for pattern, template in _moe_hf(moe):
        m = re.fullmatch(pattern, rest.removeprefix("feed_forward."))
        if m:
            return template.format(*m.groups())
    return None


def _moe_from(rest: str, fmt: str, moe: str | None) -> str | None:
    if fmt == "gguf":
        for ours, theirs in GGUF_MOE.items():
            if theirs == rest:
                return "feed_forward." + ours
        return None
    if moe is None:
        return None
    for pattern, template in _moe_hf(moe):
        regex = re.escape(template).replace(r"\{\}", r"(\d+)")
        m = re.fullmatch(regex, rest)
        if m:
            return "feed_forward." + (pattern.replace(r"(\d+)", m.group(1)) if m.groups() else pattern).replace("\\", "")
    return None


def _tables(fmt: str, sandwich: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    col, _ = _FORMATS[fmt]
    to_fmt = {k: v[col] for k, v in GLOBAL_TENSORS.items()}
    layer = {}
    for k, v in LAYER_TENSORS.items():
        name = v[2] if fmt == "hf" and sandwich and v[2] is not None else v[col]
        if name is not None:
            layer[k] = name
    return to_fmt, layer


def to_format(name: str, fmt: str, sandwich: bool = False, moe: str | None = None) -> str:
    """hardy name -> GGUF/HF name (`sandwich`: the HF names of a family with sandwich norms; `moe`: the
    HF naming style of its experts, "mixtral" or "qwen"; GGUF names stacked experts `experts.*`)."""
    globals_, layer = _tables(fmt, sandwich)
    if name in globals_:
        return globals_[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in layer:
        return _FORMATS[fmt][1].format(m.group(1)) + layer[m.group(2)]
    theirs = _moe_to(m.group(2), fmt, moe) if m else None
    if theirs is not None:
        return _FORMATS[fmt][1].format(m.group(1)) + theirs
    raise KeyError(name)


def from_format(name: str, fmt: str, sandwich: bool = False, moe: str | None = None) -> str | None:
    """GGUF/HF name -> hardy name, or None for tensors hardy does not use (e.g. rope_freqs)."""
    if fmt == "hf":
        for prefix, plain in HF_PREFIXES:
            if name.startswith(prefix):
                name = plain + name.removeprefix(prefix)
                break
    globals_, layer = _tables(fmt, sandwich)
    for ours, theirs in globals_.items():
        if theirs == name:
            return ours
    prefix = re.escape(_FORMATS[fmt][1]).replace(r"\{\}", r"(\d+)")
    m = re.fullmatch(prefix + "(.+)", name)
    if m:
        for ours, theirs in layer.items():
            if theirs == m.group(2):
                return f"layers.{m.group(1)}.{ours}"
        ours = _moe_from(m.group(2), fmt, moe)
        if ours is not None:
            return f"layers.{m.group(1)}.{ours}"
    return None


def expert_names(stacked: str, n_experts: int) -> list[str]:
    """`layers.3.feed_forward.experts.*.w1.weight` -> the n per-expert names it holds."""
    m = STACKED.fullmatch(stacked)
    return [f"{m.group(1)}.{e}.{m.group(2)}" for e in range(n_experts)]


def stacked_name(name: str) -> str | None:
    """A per-expert name -> its GGUF-stacked name (`experts.*`); None for any other tensor."""
    m = re.fullmatch(r"(layers\.\d+\.feed_forward\.experts)\.\d+\.(w[123]\.weight)", name)
    return f"{m.group(1)}.*.{m.group(2)}" if m else None


def permute_qk(w, n_heads: int):
    """HF -> llama.cpp row order for attn_q/attn_k (interleaved rotary pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_heads: int):
    """llama.cpp -> HF row order; the inverse of `permute_qk`."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_layer_count(n_layers: int, names, source) -> None:
    """The metadata's layer count against the layers whose weights are present, checked before a
    model of that depth is built (a damaged count of 4 billion would otherwise build 4 billion modules)."""
    present = {int(m.group(1)) for m in (re.match(r"layers\.(\d+)\.", n) for n in names) if m}
    if n_layers != len(present) or (present and max(present) != n_layers - 1):
        raise HardyError(f"{source}: the metadata says {n_layers} layers, the weights hold {len(present)}")


def check_weights(cfg, shapes: dict[str, tuple[int, ...]], source, optional: tuple[str, ...] = (),
                  describe=None) -> None:
    """The weights present (hardy name -> shape) against what the config implies, before they are
    converted or loaded: a damaged head count or width fails here in one line, not inside a reshape.
    `optional`: names that may be absent (a GGUF's LM head, absent when tied); `describe`: hardy name ->
    the name in the file, for the message."""
    check_layer_count(cfg.n_layers, shapes, source)
    expected = {k: tuple(v.shape) for k, v in meta_transformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(shapes) - set(optional))
    unexpected = sorted(set(shapes) - set(expected))
    shown = describe or (lambda name: name)
    if missing or unexpected:
        detail = ([f"missing {[shown(n) for n in missing[:3]]}"] if missing else []) + (
            [f"unexpected {[shown(n) for n in unexpected[:3]]}"] if unexpected else [])
        raise HardyError(f"{source}: weights do not match the model config ({'; '.join(detail)})")
    for name, shape in shapes.items():
        if shape != expected[name]:
            raise HardyError(f"{source}: tensor {shown(name)} has shape {shape}, the config implies {expected[name]}")
