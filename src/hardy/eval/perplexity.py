"""Perplexity with two protocols.

`llama.cpp` follows `llama-perplexity`: the token stream is cut into floor(N / c) chunks of c
tokens, each evaluated from an empty context; the first token becomes BOS when the vocabulary
adds one; only the logits at positions c/2 .. c-2 are scored (each predicts the next token), so
a chunk of 512 scores 255 tokens. The result is exp(mean NLL) with llama.cpp's standard error
PPL * sqrt((E[nll^2] - E[nll]^2) / (n - 1)).

`full` is the papers' protocol: non-overlapping windows of c tokens (default 2048), every token
after the first of each window scored; a shorter final window is scored too.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hardy.devices import compute_device
from hardy.errors import HardyError

PROTOCOLS = ("llama.cpp", "full")


@dataclass(frozen=True)
class Chunk:
    start: int  # token offset in the stream
    length: int  # tokens fed to the model
    first_scored: int  # first logit position scored (it predicts token first_scored + 1)
    last_scored: int  # last logit position scored (inclusive)

    @property
    def n_scored(self) -> int:
        return self.last_scored - self.first_scored + 1


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    se: float
    nll_mean: float
    n_scored: int
    n_chunks: int
    n_tokens: int
    protocol: str
    ctx: int
    # mean NLL of each chunk, in stream order: the unit for paired comparisons of two models
    chunk_nll: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def line(self) -> str:
        return (f"PPL = {self.ppl:.4f} +/- {self.se:.5f}  ({self.protocol} protocol, ctx {self.ctx}, "
                f"{self.n_chunks} chunks, {self.n_scored} scored tokens of {self.n_tokens})")

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "chunk_nll"}


@dataclass(frozen=True)
class PairedDifference:
    """B's mean NLL minus A's over the same chunks, with the standard error of that mean. Chunks, not
    tokens, are the independent units: the tokens of one chunk share a context and move together."""
    delta: float
    se: float
    n: int

    @property
    def z(self) -> float:
        if self.se > 0:
            return self.delta / self.se
        return 0.0 if self.delta == 0 else math.copysign(math.inf, self.delta)

    def significant(self, z: float = 2.0) -> bool:
        return abs(self.z) >= z


def paired_difference(a: Sequence[float], b: Sequence[float]) -> PairedDifference:
    """Is B's perplexity really different from A's on this text, or within the chunk-to-chunk noise?
    `a`, `b`: the two models' mean NLL of each chunk (`PerplexityResult.chunk_nll`), same chunks."""
    if not a or len(a) != len(b):
        raise ValueError("paired_difference needs two models' NLLs over the same chunks")
    d = torch.tensor(b, dtype=torch.float64) - torch.tensor(a, dtype=torch.float64)
    n = d.numel()
    se = (d.std().item() / math.sqrt(n)) if n > 1 else 0.0
    return PairedDifference(delta=d.mean().item(), se=se, n=n)


def plan_chunks(n_tokens: int, ctx: int, protocol: str) -> list[Chunk]:
    if protocol not in PROTOCOLS:
        raise HardyError(f"unknown perplexity protocol {protocol!r} (choose from {', '.join(PROTOCOLS)})")
    if ctx < 4:
        raise HardyError(f"--ctx must be at least 4 (got {ctx})")
    if protocol == "llama.cpp":
        if n_tokens < 2 * ctx:
            raise HardyError(f"the data has {n_tokens} tokens; the llama.cpp protocol needs at least 2*ctx = {2 * ctx}")
        return [Chunk(i * ctx, ctx, ctx // 2, ctx - 2) for i in range(n_tokens // ctx)]
    if n_tokens < 2:
        raise HardyError(f"the data has {n_tokens} tokens; at least 2 are needed")
    chunks = []
    for start in range(0, n_tokens, ctx):
        length = min(ctx, n_tokens - start)
        if length >= 2:
            chunks.append(Chunk(start, length, 0, length - 2))
    return chunks


class Perplexity(NamedTuple):
    ppl: float
    se: float  # standard error of the perplexity
    nll_mean: float


def summarize(nll: torch.Tensor) -> Perplexity:
    """Perplexity, its standard error and the mean nll exactly as llama-perplexity computes them."""
    nll = nll.double()
    n = nll.numel()
    mean = nll.mean().item()
    mean_sq = (nll * nll).mean().item()
    ppl = math.exp(mean)
    var = mean_sq - mean * mean
    se = ppl * math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0
    return Perplexity(ppl, se, mean)


def chunk_batches(chunks: list[Chunk], tokens: list[int], batch_size: int, protocol: str,
                  bos_id: int | None, add_bos: bool):
    """(chunks, token batch) groups of up to `batch_size` chunks of equal length (only a
    full-protocol tail chunk differs), with BOS in front under llama.cpp's protocol."""
    stream = torch.tensor(tokens, dtype=torch.long)
    i = 0
    while i < len(chunks):
        group = [chunks[i]]
        while (len(group) < batch_size and i + len(group) < len(chunks)
               and chunks[i + len(group)].length == chunks[i].length):
            group.append(chunks[i + len(group)])
        batch = torch.stack([stream[c.start:c.start + c.length] for c in group])
        if protocol == "llama.cpp" and add_bos and bos_id is not None:
            batch[:, 0] = bos_id
        yield group, batch
        i += len(group)


@torch.inference_mode()
def chunk_nll(model, tokens: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """NLL of tokens[:, first+1 .. last+1] given the prefix; LM head applied to scored rows only."""
    hidden = model.hidden_states(tokens)[:, first:last + 1]
    logits = model.logits(hidden).float()
    targets = tokens[:, first + 1:last + 2]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def perplexity(model, tokens: list[int], ctx: int = 512, protocol: str = "llama.cpp",
               bos_id: int | None = None, add_bos: bool = False, batch_size: int = 1,
               progress: bool = False) -> PerplexityResult:
    chunks = plan_chunks(len(tokens), ctx, protocol)
    nlls = []
    bar = None
    if progress:
        bar = tqdm(total=len(chunks), unit="chunk", desc=f"perplexity ({protocol})", dynamic_ncols=True)
    device = compute_device(model)
    for group, batch in chunk_batches(chunks, tokens, batch_size, protocol, bos_id, add_bos):
        nll = chunk_nll(model, batch.to(device), group[0].first_scored, group[0].last_scored)
        nlls.append(nll.flatten().cpu())
        if bar is not None:
            bar.update(len(group))
            running = math.exp(torch.cat(nlls).double().mean().item())
            bar.set_postfix(ppl=f"{running:.4f}")
    if bar is not None:
        bar.close()
    all_nll = torch.cat(nlls)
    summary = summarize(all_nll)
    per_chunk = tuple(part.double().mean().item() for part in all_nll.split([c.n_scored for c in chunks]))
    return PerplexityResult(ppl=summary.ppl, se=summary.se, nll_mean=summary.nll_mean, n_scored=all_nll.numel(), n_chunks=len(chunks),
                            n_tokens=len(tokens), protocol=protocol, ctx=ctx, chunk_nll=per_chunk)
