"""The architectures the planner models: hardy's Llama (SwiGLU, GQA, RMSNorm, RoPE) and GPT-style
models (multi-head attention, 4h GeLU MLP, LayerNorm with biases, learned positions, dropout),
the latter because the published validation cases (Megatron, ZeRO) use them.

Parameter counts and FLOPs live here, beside the architecture; for Llama they are hardy's own
`count_parameters`/`flops_per_token` (one implementation with the trainer).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from hardy.errors import HardyError
from hardy.loading.load import config_for
from hardy.model.config import ModelConfig, count_parameters, flops_per_token

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2/3 / Megatron layout: biases everywhere, learned positions, MLP width 4h (default)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    max_seq_len: int = 2048
    ffn_dim: int | None = None  # default 4 * dim
    tie_embeddings: bool = True
    dropout: bool = True
    name: str = "gpt-custom"
    # "unfused": Megatron's attention, softmax and dropout over materialized s×s scores (Korthikanti et
    # al.); "flash": a fused causal kernel (FlashAttention, MPT's triton kernel) that keeps none of them
    attention: str = "unfused"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if int(getattr(self, key)) <= 0:
                raise HardyError(f"invalid GPT config: {key} must be positive (got {getattr(self, key)})")
        if self.dim % self.n_heads:
            raise HardyError(f"invalid GPT config: dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.attention not in ("unfused", "flash"):
            raise HardyError(f"invalid GPT config: attention must be unfused or flash (got {self.attention!r})")

    @property
    def ffn(self) -> int:
        return self.ffn_dim or 4 * self.dim


# Korthikanti et al. 2022 (arXiv 2205.05198), Table 3: s = 2048, v = 51,200, tied embeddings.
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-22b": GPTConfig(vocab_size=51200, dim=6144, n_layers=48, n_heads=64, name="gpt-22b"),
    "gpt-175b": GPTConfig(vocab_size=51200, dim=12288, n_layers=96, n_heads=96, name="gpt-175b"),
    "gpt-530b": GPTConfig(vocab_size=51200, dim=20480, n_layers=105, n_heads=128, name="gpt-530b"),
    "gpt-1t": GPTConfig(vocab_size=51200, dim=25600, n_layers=128, n_heads=160, name="gpt-1t"),
}


@dataclass(frozen=True)
class Arch:
    """What the planner needs of a model, for either family."""

    family: str  # "llama" | "gpt"
    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    tie_embeddings: bool
    dropout: bool
    max_seq_len: int
    params_total: int
    params_per_layer: int
    params_embedding: int  # input embedding (+ learned positions for GPT)
    params_head: int  # untied LM head (0 when tied) + final norm
    flash_attention: bool = True  # a fused causal kernel: no s×s scores kept, the masked half skipped

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token: 6 x matmul parameters (the LM head included, tied or not)
        + 12·L·a·d_h·s for attention (PaLM appendix B; Megatron's 72Bslh²(1 + s/6h + V/12lh))."""
        if self.family == "llama":
            return flops_per_token(self.model_config(), seq_len)
        matmul = self.n_layers * self.layer_matmul_params() + self.vocab_size * self.dim
        return 6 * matmul + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def layer_matmul_params(self) -> int:
        """Weights of one layer's matrix multiplies (projections and MLP; no norms, no biases)."""
        mlp = (3 if self.family == "llama" else 2) * self.dim * self.ffn_dim
        return 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + mlp

    def recompute_flops_per_token(self, seq_len: int, recompute: str, fraction: float) -> float:
        """Model FLOPs per token that activation recomputation adds, in the same accounting as
        `flops_per_token` (a forward pass is a third of it): full recompute runs a layer's forward
        again (2 × its matmul weights + the attention term 4·a·d_h·s); GPT-style selective recompute
        (Korthikanti et al.) the attention core only; hardy's op-level selective keeps every matmul and
        attention output, so it recomputes no FLOPs that count (norms and activations are not counted)."""
        attention = 4 * self.n_heads * self.head_dim * seq_len
        per_layer = {"none": 0.0, "full": 2 * self.layer_matmul_params() + attention,
                     "selective": attention if self.family == "gpt" else 0.0,
                     "selective_op": 2 * self.op_recomputed_matmul_params()}[recompute]
        return fraction * self.n_layers * per_layer

    def op_recomputed_matmul_params(self) -> int:
        """Weights of the matmuls torchtitan's op-level selective checkpointing recomputes: it saves the
        output of every second matmul of a block, in call order (Llama: wq, wv, w1, w2 saved; wk, wo,
        w3 recomputed)."""
        return self.dim * self.kv_dim + self.q_dim * self.dim + self.dim * self.ffn_dim

    def model_config(self) -> ModelConfig:
        if self.family != "llama":
            raise HardyError(f"{self.name} is a GPT-style model, not a hardy Llama")
        return self._config  # type: ignore[attr-defined]

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items()}


def arch_from_llama(cfg: ModelConfig) -> Arch:
    counts = count_parameters(cfg)
    arch = Arch(family="llama", name=cfg.name, vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
                n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.d_head, ffn_dim=cfg.ffn_dim,
                tie_embeddings=cfg.tie_embeddings, dropout=cfg.dropout > 0, max_seq_len=cfg.max_seq_len,
                params_total=counts.total, params_per_layer=counts.per_layer, params_embedding=counts.embedding,
                params_head=counts.output + cfg.dim)
    object.__setattr__(arch, "_config", cfg)
    return arch


def arch_from_gpt(cfg: GPTConfig) -> Arch:
    h, f = cfg.dim, cfg.ffn
    per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+proj (+biases), MLP (+biases), 2 LayerNorms
    embedding = cfg.vocab_size * h + cfg.max_seq_len * h
    head = (0 if cfg.tie_embeddings else cfg.vocab_size * h) + 2 * h  # final LayerNorm
    return Arch(family="gpt", name=cfg.name, vocab_size=cfg.vocab_size, dim=h, n_layers=cfg.n_layers,
                n_heads=cfg.n_heads, n_kv_heads=cfg.n_heads, head_dim=h // cfg.n_heads, ffn_dim=f,
                tie_embeddings=cfg.tie_embeddings, dropout=cfg.dropout, max_seq_len=cfg.max_seq_len,
                params_total=cfg.n_layers * per_layer + embedding + head, params_per_layer=per_layer,
                params_embedding=embedding, params_head=head, flash_attention=cfg.attention == "flash")


def load_arch(spec: str) -> Arch:
    """A hardy preset, a GPT preset (gpt-22b, ...), a .gguf/model directory, or a TOML/JSON file with
    `family = "llama"|"gpt"` and the config keys of that family."""
    if spec in GPT_PRESETS:
        return arch_from_gpt(GPT_PRESETS[spec])
    path = Path(spec)
    if path.suffix in (".toml", ".json"):
        try:
            text = path.read_text()
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except OSError as e:
            raise HardyError(f"cannot read model config {path}: {e.strerror}") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise HardyError(f"model config {path} is not valid {path.suffix[1:].upper()}: {e}") from None
        data = dict(data.get("model", data))
        family = data.pop("family", "llama")
        data.setdefault("name", path.stem)
        if family == "gpt":
            try:
                return arch_from_gpt(GPTConfig(**data))
            except TypeError as e:
                raise HardyError(f"model config {path}: {e}") from None
        if family != "llama":
            raise HardyError(f"model config {path}: family must be llama or gpt (got {family!r})")
        return arch_from_llama(ModelConfig.from_dict(data))

    return arch_from_llama(config_for(spec))
