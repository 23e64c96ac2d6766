"""Autoregressive generation: one-pass prefill into a static KV cache, then token-by-token decode."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from hardy.compress.qlinear import QuantLinear
from hardy.devices import compute_device, synchronize
from hardy.errors import HardyError
from hardy.infer.fused_decode import decode_hidden
from hardy.infer.kv import PagedKVCache
from hardy.infer.speculate import kept_tokens


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise HardyError(f"--max-new-tokens must be >= 0 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise HardyError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise HardyError(f"--top-p must be in (0, 1] (got {self.top_p})")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0  # torch.compile of the decode step (before decoding; not in decode_s)
    drafted: int = 0  # speculation: guesses checked
    accepted: int = 0  # and kept

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # The first new token comes out of the prefill; decode steps produce the rest.
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


MIN_TEMPERATURE = 1e-4


def greedy(logits: torch.Tensor) -> int:
    """The first index of the largest logit. numpy's vectorized argmax on the CPU: at Gemma's 262k
    vocabulary torch.argmax took 0.3 ms of a 11 ms decode step, numpy's 0.03 ms (the same first-index
    rule on ties)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """Next token from the last position's logits [vocab]. Sampling runs on the CPU with a CPU
    generator whatever the model's device, so a seed draws the same tokens on every device."""
    if cfg.temperature < MIN_TEMPERATURE:  # below this, logits / temperature overflows: greedy is the limit
        return greedy(logits)
    probs = torch.softmax(logits.float().cpu() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_p, dim=-1)
        keep = cumulative - sorted_p < cfg.top_p  # smallest prefix whose mass reaches top_p
        keep[0] = True  # the most likely token always stays, however small top_p is (even 0 in float32)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def next_logits(model, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Logits of the last position only: the LM head (49k x 576 for SmolLM2) runs on one row.
    A cached single-token step goes through `decode_hidden` (the fused blocks where they apply)."""
    if tokens.shape[1] == 1 and model.layers[0].attention.kv_cache is not None:
        return model.logits(decode_hidden(model, tokens, start_pos)[0, -1])
    return model.logits(model.hidden_states(tokens, start_pos)[0, -1])


def _decode_step(model, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model.logits(model.hidden_states(tokens, positions)[:, -1])


_compiled_steps: dict[str, object] = {}
# Cache sizes of a compiled decode are rounded up to this many positions, so generations of similar
# lengths share one compiled graph; the extra positions are masked (attention cost only).
COMPILED_CACHE_STEP = 256


def compile_blocker(model) -> str | None:
    """Why `torch.compile` of the decode step does not apply to this model, or None when it does."""
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        return "quantized layers run hardy's own C++ kernels (one fused call for all blocks), which compile cannot trace"

    # a DTensor exists only once its module is imported; importing it here would cost every generate
    # ~0.65 s and ~40 MB (DTensor's operator tables, sympy)
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in model.parameters()):
        return "a tensor-parallel model's steps run through collectives; compile is for one process"
    return None


def compiled_decode_step(model):
    """The cached single-token step under `torch.compile` (float models): positions are a tensor and
    attention spans the whole static cache, masked, so every step has the same shapes: one compile
    per cache size (`generate` rounds it up to COMPILED_CACHE_STEP), not one per length. On CUDA it
    is also captured as a CUDA graph (mode "reduce-overhead"): a decode step is then one launch
    instead of hundreds of small kernels, whose launch cost dominates a small model's step."""
    reason = compile_blocker(model)
    if reason:
        raise HardyError(f"--compile does not apply: {reason}")
    kind = compute_device(model).type
    if kind not in _compiled_steps:
        mode = "reduce-overhead" if kind == "cuda" else None
        _compiled_steps[kind] = torch.compile(_decode_step, dynamic=False, mode=mode)
    return _compiled_steps[kind]


@torch.inference_mode()
def generate(model, prompt: list[int], cfg: SamplingConfig, stop_ids: set[int] | None = None,
             use_cache: bool = True, on_token: Callable[[int], None] | None = None,
             compile: bool = False, kv_dtype: torch.dtype = torch.float32, speculator=None) -> Generation:
    """`compile`: run the decode steps through `compiled_decode_step` (compiled before the prefill;
    the time is reported as `stats.compile_s`), over a static cache; otherwise the paged cache
    (hardy.infer.kv) holds keys and values in `kv_dtype`, its blocks taken as the tokens arrive.
    `speculator` (hardy.infer.speculate.Speculator, greedy decoding over the paged cache): guesses
    checked several at a time; the tokens are the ones decoding without it gives."""
    if not prompt:
        raise HardyError("the prompt is empty")
    if compile and not use_cache:
        raise HardyError("--compile compiles the cached decode step; it cannot be combined with --no-cache")
    if speculator is not None and (compile or not use_cache or cfg.temperature >= MIN_TEMPERATURE):
        raise HardyError("--speculate needs greedy decoding (--temperature 0) over the KV cache "
                         "(not --compile or --no-cache)")
    total = len(prompt) + cfg.max_new_tokens
    if total > model.cfg.max_seq_len:
        raise HardyError(f"prompt ({len(prompt)}) + max new tokens ({cfg.max_new_tokens}) exceeds the model's "
                         f"context of {model.cfg.max_seq_len} tokens")
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    device = compute_device(model)

    def ids(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, device=device)

    stop_ids = stop_ids or set()
    stats = GenerationStats(prompt_tokens=len(prompt))
    out: list[int] = []
    if cfg.max_new_tokens == 0:
        return Generation(out, stats)
    step = compiled_decode_step(model) if compile and cfg.max_new_tokens > 1 else None
    cache_len, pool = total, None
    if step is not None:
        cache_len = min(model.cfg.max_seq_len, -(-total // COMPILED_CACHE_STEP) * COMPILED_CACHE_STEP)
        model.setup_kv_cache(1, cache_len, keep=True)  # the same buffers each time: a CUDA graph replays on them
    elif use_cache:
        cache = PagedKVCache(model, 1, total, kv_dtype)
        pool = cache.pool
        pool.reserve(0, len(prompt))
    try:
        if step is not None:
            model.reset_rope(max(cache_len, model._rope_len))  # the compiled step never resizes the tables
            t0 = time.perf_counter()
            # Compiles (or checks its guards). It writes the cache's last position, which no step reads:
            # the last token fed back sits at total - 2, and each row only sees positions <= its own.
            step(model, ids([prompt[-1:]]), torch.tensor([cache_len - 1], device=device))
            synchronize(device)
            stats.compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = next_logits(model, ids([prompt]), 0)
        synchronize(device)  # CUDA runs asynchronously: the prefill has ended when its kernels have
        stats.prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if speculator is not None:
            _speculative_decode(model, cache, prompt, out, logits, cfg.max_new_tokens, stop_ids, on_token, speculator)
            stats.drafted, stats.accepted = speculator.drafted, speculator.accepted
        while speculator is None:
            token = sample(logits, cfg, generator)
            out.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop_ids or len(out) >= cfg.max_new_tokens:
                break
            if step is not None:
                logits = step(model, ids([[token]]), torch.tensor([len(prompt) + len(out) - 1], device=device))[0]
            elif use_cache:
                pool.reserve(0, len(prompt) + len(out))
                logits = next_logits(model, ids([[token]]), len(prompt) + len(out) - 1)
            else:
                logits = next_logits(model, ids([prompt + out]), 0)
        synchronize(device)
        stats.decode_s = time.perf_counter() - t0
    finally:
        if use_cache:
            model.clear_kv_cache()
    stats.new_tokens = len(out)
    return Generation(out, stats)


def _speculative_decode(model, cache: PagedKVCache, prompt: list[int], out: list[int], logits: torch.Tensor,
                        max_new: int, stop_ids: set[int], on_token, speculator) -> None:
    """Greedy decoding of one sequence (pool row 0) from the prompt's logits, each step feeding the last
    token and the speculator's guesses at consecutive positions in one pass: row j's logits give the
    token after guess j, kept while the guesses match (hardy.infer.speculate)."""
    seq = list(prompt)
    pending = [greedy(logits)]
    while True:
        for token in pending:
            out.append(token)
            seq.append(token)
            if on_token is not None:
                on_token(token)
            if token in stop_ids or len(out) >= max_new:
                return
        room = max_new - len(out) - 1  # the last row's logits give the final token
        guesses = speculator.propose({0: (seq, room)}, 1).get(0, []) if room > 0 else []
        rows, position = [seq[-1]] + guesses, len(seq) - 1
        cache.pool.reserve(0, position + len(rows))
        cache.use([0] * len(rows))
        t0 = time.perf_counter()
        hidden = decode_hidden(model, torch.tensor(rows, device=cache.pool.device)[:, None],
                               torch.arange(position, position + len(rows), device=cache.pool.device))
        logits = model.logits(hidden[:, -1]).float().cpu()
        speculator.observe_step(time.perf_counter() - t0, 1, len(guesses))
        pending = kept_tokens(logits, guesses, greedy)
        if guesses:
            speculator.verified(0, len(guesses), len(pending) - 1)
