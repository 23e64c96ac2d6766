"""Zero-shot query-likelihood re-ranking (Zhuang et al. 2023): a passage's score for a query is
log P(query | instruction, passage) under the language model, summed over the query's tokens.

Candidates are scored in batches: each row is the prompt with one passage followed by the query,
right-padded (causal attention: padding after a row's last token changes nothing before it), one
prefill per batch, and the LM head applied only at the positions that predict query tokens — not
the whole vocabulary at every passage position. Works on any model hardy loads (float, int8/int4
kernels, pruned) and on its device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hardy.devices import compute_device
from hardy.errors import HardyError

# A base model continues text: a passage followed by the heading it came from reads as text it has
# seen. Chosen among four on the bundled collection's dev split (BENCHMARKS.md); question-style
# queries may prefer Zhuang et al.'s "Passage: {passage}\nPlease write a question based on this
# passage.\nQuestion:". "{passage}" marks where the passage goes; the query follows the end.
DEFAULT_TEMPLATE = "Wikipedia article section.\n{passage}\n\nThe heading of this section is:"


@dataclass(frozen=True)
class QLMConfig:
    template: str = DEFAULT_TEMPLATE
    max_passage_tokens: int = 192  # a longer passage is cut (its head kept)
    batch_size: int = 16  # candidates per prefill, at most

    def __post_init__(self):
        if self.template.count("{passage}") != 1:
            raise HardyError("the QLM prompt template must contain {passage} exactly once")
        if self.max_passage_tokens < 1 or self.batch_size < 1:
            raise HardyError("max_passage_tokens and batch_size must be >= 1")


class QLMScorer:
    """Scores (query, passages) with one model; the template's fixed parts are tokenized once."""

    def __init__(self, model, tokenizer, cfg: QLMConfig | None = None, run: Callable[..., torch.Tensor] | None = None):
        """`run`: the forward pass of a batch (score_rows); a tensor-parallel leader's announces it to the
        other ranks first."""
        if tokenizer is None:
            raise HardyError("query-likelihood re-ranking needs the model's tokenizer")
        self.model, self.tok, self.cfg, self.run = model, tokenizer, cfg or QLMConfig(), run
        before, after = self.cfg.template.split("{passage}")
        self.before = tokenizer.encode(before, add_bos=True)
        self.after = tokenizer.encode(after, add_bos=False)
        self.pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0

    def score_rows(self, query: str, passages: list[str]) -> list["ScoreRow"]:
        """One scoring row per passage, prompt + passage + query (what the serving engine batches across
        requests)."""
        query_ids = self.tok.encode(" " + query.strip(), add_bos=False, special=False)  # text, never control tokens
        if not query_ids:
            raise HardyError("the query is empty")
        limit = self.model.cfg.max_seq_len
        room = limit - len(self.before) - len(self.after) - len(query_ids)
        if room < 1:
            raise HardyError(f"the query ({len(query_ids)} tokens) does not fit the model's context of {limit}")
        rows = []
        for passage in passages:
            ids = self.tok.encode(passage, add_bos=False, special=False)[:min(self.cfg.max_passage_tokens, room)]
            prefix = (self.before + ids + self.after) or [self.pad_id]  # a query token needs a position before it
            rows.append(ScoreRow(prefix + query_ids, len(prefix), query_ids))
        return rows

    def score(self, query: str, passages: list[str]) -> list[float]:
        """log P(query | prompt, passage) for each passage, in the passages' order."""
        if not passages:
            return []
        return score_rows(self.model, self.score_rows(query, passages), self.cfg.batch_size, self.pad_id, self.run)


@dataclass(frozen=True)
class ScoreRow:
    """One candidate: its tokens, where the scored continuation starts, and that continuation's ids
    (the last len(target) tokens of `tokens`)."""
    tokens: list[int]
    start: int
    target: list[int]


def batch_tensors(rows: list[ScoreRow], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded tokens [B, W], the positions predicting each target token [B, N], the targets
    [B, N] and their mask [B, N] (rows may have targets of different lengths: several queries)."""
    width = max(len(r.tokens) for r in rows)
    n = max(len(r.target) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    at = torch.zeros(len(rows), n, dtype=torch.long)
    targets = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, :len(r.tokens)] = torch.tensor(r.tokens)
        k = len(r.target)
        # position p predicts token p + 1: the target's tokens are predicted from start - 1 on
        at[i, :k] = torch.arange(r.start - 1, r.start - 1 + k)
        targets[i, :k] = torch.tensor(r.target)
        mask[i, :k] = True
    return tokens, at, targets, mask


@torch.inference_mode()
def target_log_likelihood(model, tokens: torch.Tensor, at: torch.Tensor, targets: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """Σ log P(target) per row [B] (float64): one prefill, the LM head only where a target is predicted."""
    hidden = model.hidden_states(tokens, 0)
    picked = hidden.gather(1, at[..., None].expand(-1, -1, hidden.shape[-1]))
    logp = torch.log_softmax(model.logits(picked).float(), dim=-1)
    token_logp = logp.gather(2, targets[..., None])[..., 0]
    return (token_logp * mask).sum(-1).double()


# A pass's fixed cost (reading every weight once, ~20 operators per layer; a quantized model's slabs
# dequantized again) in tokens of a row's compute: what a row of padding must save before a batch is
# split in two. 100 rather than 32: SmolLM2's re-ranking on 2 CPU cores took ~7% less time per query
# in int4 and no more in fp32 (bench/history.md, 2026-12-08).
PASS_COST_TOKENS = 100


def plan_batches(lengths: list[int], max_rows: int, pass_cost: int = PASS_COST_TOKENS) -> list[list[int]]:
    """Row indices grouped into passes of at most `max_rows`: consecutive runs of the rows sorted by
    length, chosen to minimize the padded tokens computed (rows × the pass's widest) plus `pass_cost`
    per pass — exactly, by dynamic programming over the sorted order. Cutting by count alone pads a
    pass of 40-token passages to its one 190-token row (measured: 1.8× the tokens on BM25's top 20)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest passes covering the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        widest = lengths[order[j - 1]]
        for i in range(max(0, j - max_rows), j):
            cost = best[i] + (j - i) * widest + pass_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    passes, j = [], n
    while j > 0:
        passes.append(order[cut[j]:j])
        j = cut[j]
    return passes[::-1]


def score_rows(model, rows: list[ScoreRow], batch_size: int, pad_id: int,
               run: Callable[..., torch.Tensor] | None = None) -> list[float]:
    """Each row's target log-likelihood, in the rows' order; rows of similar length share a pass
    (plan_batches). `run(tokens, at, targets, mask)` makes the forward pass (default:
    `target_log_likelihood` of `model` on its device; the serving engine passes its runner's, which
    keeps the KV cache apart)."""
    if run is None:
        device = compute_device(model)

        def run(*tensors):
            return target_log_likelihood(model, *(t.to(device) for t in tensors))

    parts = []
    for idx in plan_batches([len(r.tokens) for r in rows], batch_size):
        parts.append((idx, run(*batch_tensors([rows[i] for i in idx], pad_id))))
    scores = [0.0] * len(rows)
    for idx, values in parts:
        for i, v in zip(idx, values.tolist()):  # after every pass is queued: one device sync per batch at most
            scores[i] = v
    return scores
