"""The decoder-only transformer every supported family is a configuration of (`ModelConfig`): RMSNorm,
RoPE (Llama 3.1 or linear scaling; a second base for sliding layers), GQA attention with optional
q/k/v biases, per-head q/k norms, a sliding window per layer, a query scale and score soft-capping,
a gated MLP (SwiGLU or GELU-tanh) or a mixture of such experts (`hardy.model.moe`), optional norms on each sublayer's output, scaled embeddings and
soft-capped logits. Llama, Mistral, Qwen2/3, Gemma 3, Mixtral and Qwen2/3-MoE differ only in those settings; which file
keys set them lives in `hardy.formats.families`.

No distributed code lives here. Parallelism, activation checkpointing and compilation are
applied from outside (see `hardy.parallel`) on a model built on the meta device and then
materialized with `to_empty()` + `init_weights()`. Attention views use `-1` for the head
count so that tensor-parallel shards (fewer local heads) run through the same code.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hardy.model.config import ModelConfig, RopeScaling
from hardy.model.loss import linear_cross_entropy
from hardy.model.moe import MoE


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling.kind == "linear":  # position interpolation: positions / factor
        return (inv_freq / scaling.factor).float()
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, scaled).float()


def rope_tables(cfg: ModelConfig, seq_len: int, device=None, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [seq_len, head_dim] in the "rotate half" layout used by HF checkpoints; `local`:
    those of the sliding layers (their own base, unscaled, where the config gives one)."""
    if local and cfg.rope_local_theta is not None:
        inv_freq = rope_inv_freq(cfg.d_head, cfg.rope_local_theta, None)
    else:
        inv_freq = rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(positions, inv_freq.to(device))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class Rotary(NamedTuple):
    """The rotary tables a forward pass uses, already at its positions: the full-attention layers'
    and the sliding layers' (the same tensors unless the config gives sliding layers their own base)."""

    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor
    local_sin: torch.Tensor

    @classmethod
    def shared(cls, cos: torch.Tensor, sin: torch.Tensor) -> "Rotary":
        return cls(cos, sin, cos, sin)

    def of(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.local_cos, self.local_sin) if kind == "sliding" else (self.cos, self.sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): bounded scores (Gemma 2); `cap` None: x unchanged."""
    return x if cap is None else torch.tanh(x / cap) * cap


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class KVCache(nn.Module):
    """Static key/value cache: preallocated once, written in place at the decode position."""

    def __init__(self, batch: int, n_kv_heads: int, max_seq: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def rows(self, begin: int, end: int) -> "KVCache":
        """A cache over batch rows [begin, end) sharing this one's storage (one request's slot)."""
        view = KVCache.__new__(KVCache)
        nn.Module.__init__(view)
        view.register_buffer("k", self.k[begin:end], persistent=False)
        view.register_buffer("v", self.v[begin:end], persistent=False)
        return view

    def update(self, start: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v at `start` (an int for the whole batch, or a [batch] tensor: one position per row
        for single-token decoding of sequences of different lengths); return keys/values so far."""
        if isinstance(start, torch.Tensor):
            b = k.shape[0]
            if torch.compiler.is_compiling():  # static shapes: the whole cache, masked by the caller
                end = self.k.shape[2]
            else:
                end = int(start.max()) + 1
                if end > self.k.shape[2]:
                    raise ValueError(f"KV cache holds {self.k.shape[2]} positions; asked to write up to {end}")
            rows = torch.arange(b, device=k.device)
            self.k[rows, :, start] = k[:, :, 0].to(self.k.dtype)
            self.v[rows, :, start] = v[:, :, 0].to(self.v.dtype)
            return self.k[:b, :, :end].to(k.dtype), self.v[:b, :, :end].to(v.dtype)
        b, end = k.shape[0], start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; asked to write up to {end}")
        self.k[:b, :, start:end] = k
        self.v[:b, :, start:end] = v
        return self.k[:b, :, :end].to(k.dtype), self.v[:b, :, :end].to(v.dtype)  # read in the compute dtype


def attention_mask(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """Which keys each query sees: [..., queries, k_len] booleans for query positions `q_pos`
    [..., queries]: every earlier position and itself, within the last `window` positions if given."""
    k_pos = torch.arange(k_len, device=q_pos.device)
    allowed = k_pos <= q_pos[..., None]
    if window is not None:
        allowed = allowed & (k_pos > q_pos[..., None] - window)
    return allowed


def expand_kv_for_sdpa(q: torch.Tensor, mask) -> bool:
    """Whether grouped K/V heads must be expanded before SDPA to keep a fused kernel: on CUDA, SDPA's
    native GQA (enable_gqa) runs only in the flash kernel, which takes neither fp32 nor an explicit
    mask; such a call would fall back to the math kernel (the whole score matrix in memory). Expanded,
    it runs in the memory-efficient kernel. Elsewhere native GQA costs no copy and stays."""
    return q.is_cuda and (mask is not None or q.dtype == torch.float32)


def attend(q, k, v, mask, causal: bool, scale: float | None, cap: float | None,
           expand_kv: bool | None = None) -> torch.Tensor:
    """softmax(q·kᵀ · scale [soft-capped], masked) · v with grouped KV heads. `expand_kv`: repeat the
    KV heads for each query head instead of SDPA's native GQA (default: expand_kv_for_sdpa)."""
    groups = q.shape[1] // k.shape[1]
    if cap is None:
        if groups > 1 and (expand_kv_for_sdpa(q, mask) if expand_kv is None else expand_kv):
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # native GQA inside the kernel otherwise: no repeated copies of K/V (and none to sum back in backward)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    # SDPA has no soft-cap: the scores are computed here
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = softcap((q @ k.transpose(-1, -2)).float() * (scale or q.shape[-1] ** -0.5), cap)
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.head_dim = cfg.d_head
        self.window = cfg.window(layer)
        self.scale, self.cap = cfg.attn_scale, cfg.attn_softcap
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.d_head, bias=cfg.attn_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.d_head, bias=cfg.attn_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.d_head, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.d_head, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.d_head, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.d_head, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int | torch.Tensor = 0) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, causal = None, s > 1
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(start_pos, k, v)
        keys, windowed = k.shape[2], self.window is not None and self.window < k.shape[2]
        if isinstance(start_pos, torch.Tensor):  # batched decode: row i sees keys up to start_pos[i]
            mask, causal = attention_mask(start_pos[:, None, None], keys, self.window), False
        elif s == 1 and not windowed:  # one new token sees every key
            causal = False
        elif keys != s or windowed:  # a prefill that continues a cache, or a window: explicit positions
            q_pos = torch.arange(start_pos, start_pos + s, device=x.device)
            mask, causal = attention_mask(q_pos, keys, self.window), False
        y = attend(q, k, v, mask, causal, self.scale, self.cap)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down
        self.act = cfg.mlp_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return self.w2(gate * self.w3(x))


# Every linear of a dense block, in the order its forward reads them (the fused decode block,
# hardy.compress.csrc/decode_layer.cpp, takes their weights in this order; it computes no MoE block).
BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.kind = cfg.kinds[layer]
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, layer)
        # Gemma 2/3: each sublayer's output is normalized again before it joins the residual stream
        self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.sandwich_norms else None
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.is_moe(layer) else FeedForward(cfg)
        self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.sandwich_norms else None
        self.dropout = cfg.dropout

    def _drop(self, y: torch.Tensor) -> torch.Tensor:
        # p = 0 calls nothing, so a model without dropout draws no random numbers and runs the same graph
        return F.dropout(y, self.dropout, training=True) if self.training and self.dropout else y

    def forward(self, x: torch.Tensor, rope: Rotary, start_pos: int | torch.Tensor = 0) -> torch.Tensor:
        cos, sin = rope.of(self.kind)
        a = self.attention(self.attention_norm(x), cos, sin, start_pos)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + self._drop(a)
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        return h + self._drop(f)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self._rope_len = 0
        # the compiled decode's static cache, kept between generations: a CUDA graph replays on the
        # addresses it was captured with, so a cache allocated anew each time would be captured anew
        self.kept_kv_caches: list[KVCache] = []
        # empty until reset_rope() sizes them (computing even a 0-row table on the meta device would
        # run arange's Python reference, ~1 s of one-time imports); the local ones stay empty unless
        # sliding layers have a base of their own
        for name in ("rope_cos", "rope_sin", "rope_cos_local", "rope_sin_local"):
            self.register_buffer(name, torch.empty(0, cfg.d_head), persistent=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def initial_state(self, seed: int | None = None, std: float = 0.02):
        """(name, full tensor) of a fresh initialization, in parameter order, from one seeded stream.

        Layout-independent: a sharded copy of the model is initialized from the same values.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        out_std = std / math.sqrt(2 * self.cfg.n_layers)  # residual-branch outputs (GPT-2 practice)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                yield name, torch.ones(p.shape)
            elif name.endswith(".bias"):
                yield name, torch.zeros(p.shape)
            else:
                scale = out_std if name.endswith(("wo.weight", "w2.weight")) else std
                yield name, torch.randn(p.shape, generator=gen) * scale

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, std: float = 0.02) -> None:
        """Initialize every parameter and buffer in place (after `to_empty()` on a meta model)."""
        self.tie_weights()
        params = dict(self.named_parameters())
        for name, value in self.initial_state(seed, std):
            params[name].copy_(value)
        self.reset_rope()

    @property
    def local_rope(self) -> bool:
        """Do the sliding layers have rotary tables of their own?"""
        return self.cfg.rope_local_theta is not None and "sliding" in self.cfg.kinds

    def reset_rope(self, seq_len: int | None = None, device: torch.device | str | None = None) -> None:
        """(Re)build the rotary tables; cheap, grows on demand. They stay where the forward runs: on
        `device`, else where they already are (parameters may live elsewhere: FSDP2's CPU offload)."""
        seq_len = seq_len or min(self.cfg.max_seq_len, 4096)
        if device is None:
            device = self.rope_cos.device
            if device.type == "meta":
                device = self.norm.weight.device
            if device.type == "meta":  # a model not materialized yet: real tables on the default device
                device = None
        self.rope_cos, self.rope_sin = rope_tables(self.cfg, seq_len, device)
        if self.local_rope:
            self.rope_cos_local, self.rope_sin_local = rope_tables(self.cfg, seq_len, device, local=True)
        else:  # unused, but off the meta device like the rest of the model
            self.rope_cos_local = self.rope_sin_local = self.rope_cos.new_empty(0, self.cfg.d_head)
        self._rope_len = seq_len

    def rotary(self, start_pos: int | torch.Tensor, end: int, dtype: torch.dtype) -> Rotary:
        """The tables at positions [start_pos, end), or at each row's one position (a [batch] tensor:
        then [batch, 1 (heads), 1 (seq), head_dim], broadcasting against q/k)."""
        def at(table: torch.Tensor) -> torch.Tensor:
            if isinstance(start_pos, torch.Tensor):
                return table[start_pos][:, None, None, :].to(dtype)
            return table[start_pos:end].to(dtype)

        cos, sin = at(self.rope_cos), at(self.rope_sin)
        if not self.local_rope:
            return Rotary.shared(cos, sin)
        return Rotary(cos, sin, at(self.rope_cos_local), at(self.rope_sin_local))

    def setup_kv_cache(self, batch: int, max_seq: int, dtype: torch.dtype | None = None, keep: bool = False) -> None:
        """A static cache [batch, max_seq] per layer (compiled decoding, tests); generation and serving
        use the paged one (hardy.infer.kv). `keep`: reuse the kept cache where it has this shape, dtype and
        device, else allocate one and keep it (`clear_kv_cache` detaches it from the layers, no more).
        Stale entries need no clearing: a position is written before any row attends to it."""
        dtype = dtype or self.norm.weight.dtype
        device = self.rope_cos.device  # where the forward runs
        shapes = [(batch, heads, max_seq, layer.attention.head_dim)
                  for layer, heads in zip(self.layers, self.local_kv_heads())]
        kept = self.kept_kv_caches
        if keep and len(kept) == len(shapes) and all(
                tuple(c.k.shape) == shape and c.k.dtype == dtype and c.k.device == device for c, shape in zip(kept, shapes)):
            caches = kept
        else:
            caches = [KVCache(*shape, dtype, device) for shape in shapes]
            if keep:
                self.kept_kv_caches = caches
        for layer, cache in zip(self.layers, caches):
            layer.attention.kv_cache = cache
        if self._rope_len < max_seq:
            self.reset_rope(max_seq)

    def local_kv_heads(self) -> list[int]:
        """The KV heads each block holds in this process (fewer on a tensor-parallel shard)."""
        heads = []
        for layer in self.layers:
            wk = layer.attention.wk  # a quantized layer (hardy.compress) keeps no float weight
            rows = wk.weight.shape[0] if hasattr(wk, "weight") else wk.out_features
            if hasattr(wk, "weight") and hasattr(wk.weight, "to_local"):  # sharded by a parallelize step
                rows = wk.weight.to_local().shape[0]
            heads.append(rows // layer.attention.head_dim)
        return heads

    def clear_kv_cache(self) -> None:
        for layer in self.layers:
            layer.attention.kv_cache = None

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings, scaled where the family scales them (Gemma: by sqrt(dim), the factor
        rounded to the embeddings' dtype as its reference implementation does)."""
        h = self.tok_embeddings(tokens)
        if self.cfg.embed_scale != 1.0:
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states (soft-capped where the family caps them)."""
        return softcap(self.output(h), self.cfg.logit_softcap)

    def hidden_states(self, tokens: torch.Tensor, start_pos: int | torch.Tensor = 0) -> torch.Tensor:
        """Final normalized hidden states [batch, seq, dim] (the LM head is applied separately).

        `start_pos` may be a [batch] tensor of positions for one token per row (batched decoding of
        sequences of different lengths, with the KV cache set up)."""
        per_row = isinstance(start_pos, torch.Tensor)
        if per_row and tokens.shape[1] != 1:
            raise ValueError("per-row positions are for single-token decoding")
        # A compiled decode step reads no position back to Python (that would break the graph): its
        # caller sized the RoPE tables for the whole generation first.
        end = 0 if torch.compiler.is_compiling() else (int(start_pos.max()) if per_row else start_pos) + tokens.shape[1]
        if end > self._rope_len:
            if end > self.cfg.max_seq_len:
                raise ValueError(f"sequence of {end} positions exceeds max_seq_len {self.cfg.max_seq_len}")
            self.reset_rope(max(end, min(2 * self._rope_len, self.cfg.max_seq_len)))
        rope = self.rotary(start_pos, end, self.norm.weight.dtype)
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, rope, start_pos)
        return self.norm(h)

    def forward(self, tokens: torch.Tensor, start_pos: int | torch.Tensor = 0, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab]; with `targets`, the mean next-token loss instead (no full logits)."""
        h = self.hidden_states(tokens, start_pos)
        if targets is not None:
            if self.cfg.logit_softcap is not None:  # the fused loss has no soft-cap: full logits
                return F.cross_entropy(self.logits(h).flatten(0, 1).float(), targets.flatten())
            return linear_cross_entropy(h.flatten(0, 1), self.output.weight, targets.flatten())
        return self.logits(h)


_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                 "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


def _keep(tensor, *args, **kwargs):
    return tensor


def meta_transformer(cfg: ModelConfig) -> Transformer:
    """The model on the meta device, shapes only: the modules' own initializers are skipped, as the
    weights come next (a file, a checkpoint or init_weights) — and a meta tensor's first normal_ costs
    ~1 s of one-time imports, a fifth of an 8B model's load."""
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    try:
        for name in _INITIALIZERS:
            setattr(nn.init, name, _keep)
        with torch.device("meta"):
            return Transformer(cfg)
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int | None = 0,
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Build on the meta device, then materialize on `device` with initialized weights."""
    model = meta_transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model.to(dtype)
