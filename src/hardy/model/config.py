"""Typed model configuration, presets and the analytic parameter count.

The parameter count lives beside the config it describes and is checked against
`sum(p.numel())` of a real (or meta-device) model in the tests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hardy.errors import HardyError


ROPE_SCALINGS = ("llama3", "linear")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of the full-attention layers: Llama 3.1's frequency-dependent one
    (`kind` "llama3") or plain position interpolation (`kind` "linear": every frequency / factor, as
    Gemma 3's larger models scale their global layers)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    kind: str = "llama3"


MOE_ROUTERS = ("softmax_topk",)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: `top_k` of `n_experts` gated MLPs of width `ffn_dim` per token.
    `norm_topk_prob`: the chosen experts' weights are renormalized to sum to 1 (Mixtral: always);
    `shared_ffn_dim`: a shared expert every token also passes through (Qwen2-MoE), scaled by a sigmoid
    gate if `shared_gate`; `dense_layers`: layers that keep the dense MLP of width ModelConfig.ffn_dim."""

    n_experts: int
    top_k: int
    ffn_dim: int
    norm_topk_prob: bool = True
    router: str = "softmax_topk"
    shared_ffn_dim: int = 0
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def problems(self, n_layers: int) -> list[str]:
        out = []
        if not 0 < self.top_k <= self.n_experts:
            out.append(f"moe top_k must be in [1, n_experts = {self.n_experts}] (got {self.top_k})")
        if self.ffn_dim <= 0 or self.shared_ffn_dim < 0:
            out.append(f"moe widths must be positive (ffn_dim {self.ffn_dim}, shared {self.shared_ffn_dim})")
        if self.router not in MOE_ROUTERS:
            out.append(f"moe router must be one of {', '.join(MOE_ROUTERS)} (got {self.router!r})")
        if any(not 0 <= i < n_layers for i in self.dense_layers):
            out.append(f"moe dense_layers must be layer indices below {n_layers} (got {list(self.dense_layers)})")
        return out


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    name: str = "custom"
    # Residual dropout (on each attention and MLP output before it joins the residual stream), active
    # only in training mode: a regularizer for small models trained for several epochs on little text.
    dropout: float = 0.0
    # --- Architecture options: the families (Qwen, Mistral, Gemma ...) are settings of one block.
    family: str = "llama"  # the file family (HF model_type / GGUF architecture) exports write back
    attn_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # a norm also on each sublayer's output, before the residual add (Gemma 2/3)
    mlp_act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_tanh (GeGLU: Gemma)
    embed_scale: float = 1.0  # the embeddings are multiplied by this (Gemma: sqrt(dim))
    attn_scale: float | None = None  # the query scale; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    attn_softcap: float | None = None  # cap * tanh(score / cap) on attention scores (Gemma 2)
    logit_softcap: float | None = None  # the same on the final logits (Gemma 2)
    sliding_window: int | None = None  # how many positions (itself included) a "sliding" layer's query sees
    layer_types: tuple[str, ...] = ()  # "full" | "sliding" per layer; () = every layer full
    rope_local_theta: float | None = None  # the RoPE base of sliding layers (Gemma 3); None: rope_theta
    moe: MoEConfig | None = None  # experts in place of the dense MLP (Mixtral, Qwen2/3-MoE)

    def __post_init__(self) -> None:
        problems = []
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if int(getattr(self, key)) <= 0:
                problems.append(f"{key} must be positive (got {getattr(self, key)})")
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not problems and self.head_dim is None and self.dim % self.n_heads:
            problems.append(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            problems.append(f"head_dim must be a positive even number (got {self.head_dim})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1) (got {self.dropout})")
        problems += self._architecture_problems()
        if problems:
            raise HardyError("invalid model config: " + "; ".join(problems))

    def _architecture_problems(self) -> list[str]:
        problems = []
        if self.mlp_act not in MLP_ACTIVATIONS:
            problems.append(f"mlp_act must be one of {', '.join(MLP_ACTIVATIONS)} (got {self.mlp_act!r})")
        if self.rope_scaling is not None and self.rope_scaling.kind not in ROPE_SCALINGS:
            problems.append(f"rope scaling must be one of {', '.join(ROPE_SCALINGS)} (got {self.rope_scaling.kind!r})")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                problems.append(f"layer_types lists {len(self.layer_types)} layers, the model has {self.n_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_KINDS))
            if bad:
                problems.append(f"layer_types: unknown kind {bad[0]!r} (known: {', '.join(LAYER_KINDS)})")
            if "sliding" in self.layer_types and not (self.sliding_window or 0) > 0:
                problems.append("sliding layers need a positive sliding_window")
        for key in ("attn_softcap", "logit_softcap", "attn_scale"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                problems.append(f"{key} must be positive (got {value})")
        if not self.embed_scale > 0:
            problems.append(f"embed_scale must be positive (got {self.embed_scale})")
        if self.moe is not None:
            if self.moe.n_experts <= 0:
                problems.append(f"moe n_experts must be positive (got {self.moe.n_experts})")
            else:
                problems += self.moe.problems(self.n_layers)
        return problems

    def is_moe(self, layer: int) -> bool:
        """Does `layer` route to experts (rather than run the dense MLP)?"""
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention: "full" or "sliding" (a window of `sliding_window` positions)."""
        return self.layer_types or ("full",) * self.n_layers

    def window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: every earlier position)."""
        return self.sliding_window if self.kinds[layer] == "sliding" else None

    def first_layers(self, n: int, name: str | None = None) -> "ModelConfig":
        """Only the first `n` blocks (their layer kinds kept)."""
        moe = self.moe and dataclasses.replace(self.moe, dense_layers=tuple(i for i in self.moe.dense_layers if i < n))
        return self.replace(n_layers=n, layer_types=self.layer_types[:n], name=name or self.name, moe=moe)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HardyError(f"unknown model config keys: {', '.join(unknown)}")
        if isinstance(data.get("rope_scaling"), dict):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        if isinstance(data.get("layer_types"), list):
            data["layer_types"] = tuple(data["layer_types"])
        if isinstance(data.get("moe"), dict):
            moe = dict(data["moe"])
            moe["dense_layers"] = tuple(moe.get("dense_layers", ()))
            data["moe"] = MoEConfig(**moe)
        return cls(**data)


_LLAMA31_SCALING = RopeScaling()

PRESETS: dict[str, ModelConfig] = {
    # Unit tests: small enough that a training step takes milliseconds.
    "micro": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                         max_seq_len=256, tie_embeddings=True, name="micro"),
    # Compression tests: widths divisible by 128 (quantization groups), trains in under a minute.
    "mini": ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                        max_seq_len=256, tie_embeddings=True, name="mini"),
    # The from-scratch reference model of the compression benchmarks (configs/small-wikitext.toml):
    # ~7M parameters, 8k BPE vocabulary, every width a multiple of 128.
    "small": ModelConfig(vocab_size=8192, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=768,
                         max_seq_len=512, tie_embeddings=True, name="small"),
    # A few million parameters: trains in minutes on 2 CPU cores (8k BPE vocabulary).
    "tiny": ModelConfig(vocab_size=8192, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688,
                        max_seq_len=512, tie_embeddings=True, name="tiny"),
    "smollm2-135m": ModelConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                                ffn_dim=1536, rope_theta=100000.0, max_seq_len=8192,
                                tie_embeddings=True, name="smollm2-135m"),
    "llama3.1-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                               ffn_dim=14336, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                               max_seq_len=131072, name="llama3.1-8b"),
    "llama3.1-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                ffn_dim=28672, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                                max_seq_len=131072, name="llama3.1-70b"),
    "llama3.1-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                 ffn_dim=53248, rope_theta=500000.0, rope_scaling=_LLAMA31_SCALING,
                                 max_seq_len=131072, name="llama3.1-405b"),
    # Mixtures of experts (Qwen3-MoE): for planning (`hardy plan serve --model qwen3-235b-a22b`)
    "qwen3-30b-a3b": ModelConfig(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                                 head_dim=128, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960,
                                 name="qwen3-30b-a3b", family="qwen3_moe", qk_norm=True,
                                 moe=MoEConfig(n_experts=128, top_k=8, ffn_dim=768)),
    "qwen3-235b-a22b": ModelConfig(vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                                   ffn_dim=12288, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0,
                                   max_seq_len=40960, name="qwen3-235b-a22b", family="qwen3_moe", qk_norm=True,
                                   moe=MoEConfig(n_experts=128, top_k=8, ffn_dim=1536)),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise HardyError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})") from None


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    attention: int
    mlp: int
    norms: int
    output: int
    per_layer: int = field(default=0)
    active_mlp: int | None = None  # MoE: the MLP parameters one token uses (router, its top-k experts, shared)

    @property
    def active(self) -> int:
        """Parameters one token reads (all of them for a dense model; fewer with experts)."""
        return self.total - self.mlp + (self.mlp if self.active_mlp is None else self.active_mlp)

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.output

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_parameters(cfg: ModelConfig) -> ParamCount:
    """Exact parameter count of `Transformer(cfg)`, without building it."""
    q_out, kv_out = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    attention = cfg.dim * q_out + 2 * cfg.dim * kv_out + q_out * cfg.dim
    if cfg.attn_bias:
        attention += q_out + 2 * kv_out
    dense_mlp = 3 * cfg.dim * cfg.ffn_dim
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    moe_mlp = active_mlp = 0
    if cfg.moe is not None:
        m = cfg.moe
        shared = 3 * cfg.dim * m.shared_ffn_dim + (cfg.dim if m.shared_ffn_dim and m.shared_gate else 0)
        moe_mlp = cfg.dim * m.n_experts + m.n_experts * 3 * cfg.dim * m.ffn_dim + shared
        active_mlp = cfg.dim * m.n_experts + m.top_k * 3 * cfg.dim * m.ffn_dim + shared
    mlp = dense_mlp
    layer_norms = (4 if cfg.sandwich_norms else 2) * cfg.dim + (2 * cfg.d_head if cfg.qk_norm else 0)
    embedding = cfg.vocab_size * cfg.dim
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return ParamCount(
        embedding=embedding,
        attention=cfg.n_layers * attention,
        mlp=(cfg.n_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp,
        norms=cfg.n_layers * layer_norms + cfg.dim,
        output=output,
        per_layer=attention + (moe_mlp if moe_layers == cfg.n_layers else mlp) + layer_norms,
        active_mlp=(cfg.n_layers - moe_layers) * dense_mlp + moe_layers * active_mlp,
    )


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention (PaLM appendix B).

    Matmul parameters exclude an untied input embedding (a lookup); a tied one is the LM head. With
    experts, only those a token is routed to count (`ParamCount.active`).
    """
    counts = count_parameters(cfg)
    matmul_params = counts.active - (counts.embedding if not cfg.tie_embeddings else 0) - counts.norms
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.n_heads * cfg.d_head * seq_len
