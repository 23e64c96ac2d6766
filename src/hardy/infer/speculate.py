"""Speculative decoding: guess the next few tokens cheaply, check them all in one forward pass of the
model, keep the longest prefix the model agrees with and the model's own token after it.

The check is a decode step in which a sequence fills several rows at consecutive positions (the same
rows chunked prefill rides on: the weights are read once for all of them, each row sees the keys up to
its own position). Row j's logits give the token after the j-th guess, so a greedy sequence's output is
the one plain decoding gives, whatever the guesses: a wrong guess only costs its row. Keys and values
the rejected rows wrote sit beyond the sequence's position and are written over before any row reads
them.

Two ways to guess (`--speculate`):
- `ngram` (prompt lookup): the continuation of the latest earlier occurrence of the sequence's last
  1-3 tokens — copies from the prompt or from itself, at no model cost; no match, no guess.
- `draft:MODEL`: a small model with the same vocabulary decodes k tokens greedily, every speculating
  sequence of the batch in one pass per token, over a paged KV cache of its own.

Guesses are drafted while they pay (`DraftPolicy`): a drafted row costs a measured share of a step and
returns a token only as often as the sequence's guesses have been accepted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hardy.errors import HardyError
from hardy.infer.fused_decode import decode_hidden
from hardy.infer.kv import PagedKVCache

DEFAULT_TOKENS = 6  # drafted per step at most
MAX_TOKENS = 32
NGRAM_MAX = 3  # the longest suffix looked up


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str  # "ngram" or "draft"
    tokens: int = DEFAULT_TOKENS
    draft_model: str | None = None

    @property
    def label(self) -> str:
        return "ngram" if self.mode == "ngram" else f"draft:{self.draft_model}"


def parse_speculate(value: str | None, tokens: int = DEFAULT_TOKENS) -> SpeculationConfig | None:
    """`--speculate off|ngram|draft:MODEL` with `--speculate-tokens`; None when off."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise HardyError(f"--speculate-tokens must be in [1, {MAX_TOKENS}] (got {tokens})")
    if value in (None, "", "off"):
        return None
    if value == "ngram":
        return SpeculationConfig("ngram", tokens)
    if value.startswith("draft:") and value[len("draft:"):]:
        return SpeculationConfig("draft", tokens, value[len("draft:"):])
    raise HardyError(f"--speculate must be off, ngram or draft:MODEL (got {value!r})")


class NgramIndex:
    """Where each 1..NGRAM_MAX-gram of a sequence last occurred with a token after it, kept up to date
    as the sequence grows (a few dictionary writes per token, not a scan of the context)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> the start of its latest continued occurrence

    def extend(self, context: list[int]) -> None:
        """Catch up with `context`, which continues what was seen."""
        for t in range(len(self.tokens), len(context)):
            for n in range(1, NGRAM_MAX + 1):  # the n-grams that token t continues
                if t - n >= 0:
                    self.last[tuple(context[t - n:t])] = t - n
        self.tokens.extend(context[len(self.tokens):])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        seq = self.tokens
        for n in range(min(NGRAM_MAX, len(seq) - 1), 0, -1):
            start = self.last.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start + n:start + n + k]
        return []


def smoothed(old: float | None, new: float) -> float:
    """An exponential moving average's next value; `new` itself while nothing was measured (None or 0)."""
    return new if not old else 0.7 * old + 0.3 * new


def kept_tokens(logits: torch.Tensor, guesses: list[int], pick) -> list[int]:
    """A sequence's new tokens from its rows' logits [len(guesses) + 1, V]: row j's token (`pick`) follows
    guess j, so they are taken while they equal the guesses, and one more."""
    tokens = []
    for j in range(len(guesses) + 1):
        tokens.append(pick(logits[j]))
        if j == len(guesses) or tokens[-1] != guesses[j]:
            break
    return tokens


class DraftPolicy:
    """How many tokens to draft for a sequence this step. A drafted row pays when the tokens it returns
    (the sequence's acceptance rate per guess, `rate`) are worth more of the batch's throughput than
    it and its guess cost: rate^i > batch x (row_s + guess_s) / plain_s for the i-th guess. The costs
    are measured (smoothed step times); a sequence that stops drafting tries one guess again every RETRY steps."""

    DECAY, RETRY = 0.8, 16

    def __init__(self, most: int):
        self.most = most
        self.plain_s: dict[int, float] = {}  # step time without drafted rows, by batch size
        self.row_s = 0.0  # what one drafted row adds to a step (0 until measured: draft)
        self.guess_s = 0.0  # what making one guess takes (a draft model's passes; ngram: ~0)
        self.hits: dict[int, list[float]] = {}  # sequence -> [accepted, tried] (decayed)
        self.idle: dict[int, int] = {}  # sequence -> steps since it last drafted

    def observe_step(self, seconds: float, batch: int, drafted_rows: int) -> None:
        if not drafted_rows:
            self.plain_s[batch] = smoothed(self.plain_s.get(batch), seconds)
        elif batch in self.plain_s:
            self.row_s = smoothed(self.row_s, max(0.0, (seconds - self.plain_s[batch]) / drafted_rows))

    def observe_guesses(self, seconds: float, guesses: int) -> None:
        if guesses:
            self.guess_s = smoothed(self.guess_s, seconds / guesses)

    def rate(self, seq: int) -> float:
        accepted, tried = self.hits.get(seq, (1.0, 1.0))
        return accepted / tried

    def budget(self, seq: int, batch: int) -> int:
        """Guesses worth drafting for `seq` now (0: none)."""
        plain = self.plain_s.get(batch)
        threshold = batch * (self.row_s + self.guess_s) / plain if plain else 0.0
        rate, k = self.rate(seq), 0
        while k < self.most and rate ** (k + 1) > threshold:
            k += 1
        if k == 0:
            self.idle[seq] = self.idle.get(seq, 0) + 1
            if self.idle[seq] >= self.RETRY:
                return 1
        return k

    def verified(self, seq: int, drafted: int, accepted: int) -> None:
        """`accepted` of `drafted` guesses held: accepted successes in accepted + (1 if one failed) trials."""
        old = self.hits.get(seq, [1.0, 1.0])
        tried = accepted + (accepted < drafted)
        self.hits[seq] = [self.DECAY * old[0] + accepted, self.DECAY * old[1] + tried]
        self.idle[seq] = 0

    def release(self, seq: int) -> None:
        self.hits.pop(seq, None)
        self.idle.pop(seq, None)


class DraftModel:
    """A small model's greedy guesses for many sequences at once, over its own paged KV cache. `seen`
    holds the tokens each sequence's cache was fed, guesses included; a proposal keeps the prefix the
    sequence still agrees with and feeds the rest (a new prompt, the tokens accepted since) as rows at
    consecutive positions in its first pass."""

    CATCH_UP_PASS = 64  # more tokens than this to catch up go in a prefill pass of their own

    def __init__(self, model, sequences: int, context: int, kv_dtype: torch.dtype):
        self.model = model
        self.cache = PagedKVCache(model, sequences, context, kv_dtype)
        self.pool = self.cache.pool
        self.seen: list[list[int]] = [[] for _ in range(sequences)]
        self.sure = [0] * sequences  # leading tokens of `seen` that came from the sequence, not a guess

    def _agreed(self, seq: int, context: list[int]) -> int:
        """Positions of the draft's cache still valid for `context` (never its last token: that one is
        fed, so every sequence has a row to guess from)."""
        seen, i = self.seen[seq], self.sure[seq]
        while i < len(seen) and i < len(context) - 1 and seen[i] == context[i]:
            i += 1
        del seen[i:]
        return i

    @torch.inference_mode()
    def propose(self, wanted: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """{sequence: (its tokens so far, how many to guess)} -> {sequence: guesses}."""
        rows, tokens, positions, want = [], [], [], []
        for seq, (context, _) in wanted.items():
            fed = self._agreed(seq, context)
            if len(context) - 1 - fed > self.CATCH_UP_PASS:
                self._prefill(seq, context[fed:-1], fed)
                fed = len(context) - 1
            rows += [seq] * (len(context) - fed)
            tokens += context[fed:]
            positions += range(fed, len(context))
            want.append(len(rows) - 1)
            self.seen[seq].extend(context[len(self.seen[seq]):])  # its agreed prefix, then what this pass feeds
            self.sure[seq] = len(context)
        out = {seq: [] for seq in wanted}
        live = list(wanted)
        while live:
            for seq, token in zip(live, self._step(rows, tokens, positions, want)):
                out[seq].append(token)
            live = [seq for seq in live if len(out[seq]) < wanted[seq][1]]
            rows, tokens = live, [out[seq][-1] for seq in live]
            positions = [len(self.seen[seq]) for seq in live]
            want = list(range(len(live)))
            for seq, token in zip(live, tokens):
                self.seen[seq].append(token)
        return out

    def _step(self, rows: list[int], tokens: list[int], positions: list[int], want: list[int]) -> list[int]:
        for row, position in zip(rows, positions):
            self.pool.reserve(row, position + 1)
        self.cache.use(rows)
        hidden = decode_hidden(self.model, torch.tensor(tokens)[:, None], torch.tensor(positions))[:, -1]
        return self.model.logits(hidden[want]).argmax(dim=-1).tolist()

    def _prefill(self, seq: int, tokens: list[int], start: int) -> None:
        self.pool.reserve(seq, start + len(tokens))
        self.cache.use([seq])
        self.model.hidden_states(torch.tensor([tokens]), start)

    def release(self, seq: int) -> None:
        self.pool.release(seq)
        self.seen[seq], self.sure[seq] = [], 0


class Speculator:
    """Guesses for the sequences of a batch, and the policy that decides how many (one per engine or
    generation)."""

    PLAIN_EVERY = 64

    def __init__(self, cfg: SpeculationConfig, draft: DraftModel | None = None):
        if (cfg.mode == "draft") != (draft is not None):
            raise HardyError("--speculate draft:MODEL needs its draft model, ngram none")
        self.cfg, self.draft = cfg, draft
        self.policy = DraftPolicy(cfg.tokens)
        self.ngrams: dict[int, NgramIndex] = {}
        self.drafted = self.accepted = 0  # totals, for /metrics and --stats
        self.steps: dict[int, int] = {}  # proposals asked for, by batch size

    def propose(self, contexts: dict[int, tuple[list[int], int]], batch: int) -> dict[int, list[int]]:
        """{sequence: (tokens so far, most guesses that fit)} -> the guesses worth checking this step.
        Every PLAIN_EVERY-th step of a batch size (the first included) drafts nothing: what a plain step
        takes is measured, not assumed."""
        step = self.steps[batch] = self.steps.get(batch, -1) + 1
        if step % self.PLAIN_EVERY == 0:
            return {}
        limits = {seq: min(limit, self.policy.budget(seq, batch)) for seq, (_, limit) in contexts.items()}
        wanted = {seq: (contexts[seq][0], n) for seq, n in limits.items() if n > 0}
        if not wanted:
            return {}
        if self.draft is not None:
            t0 = time.perf_counter()
            out = self.draft.propose(wanted)
            self.policy.observe_guesses(time.perf_counter() - t0, sum(map(len, out.values())))
            return out
        out = {}
        for seq, (context, n) in wanted.items():
            index = self.ngrams.setdefault(seq, NgramIndex())
            index.extend(context)
            guess = index.propose(n)
            if guess:
                out[seq] = guess
        return out

    def verified(self, seq: int, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.policy.verified(seq, drafted, accepted)

    def observe_step(self, seconds: float, batch: int, drafted_rows: int) -> None:
        self.policy.observe_step(seconds, batch, drafted_rows)

    def release(self, seq: int) -> None:
        self.policy.release(seq)
        self.ngrams.pop(seq, None)
        if self.draft is not None:
            self.draft.release(seq)


def check_draft(target, draft, context: int) -> None:
    """A draft model must share the target's vocabulary and hold the context."""
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise HardyError(f"the draft model's vocabulary ({draft.cfg.vocab_size} tokens) is not the model's "
                         f"({target.cfg.vocab_size}): --speculate draft:MODEL needs the same tokenizer")
    if draft.cfg.max_seq_len < context:
        raise HardyError(f"the draft model's context ({draft.cfg.max_seq_len}) is shorter than the {context} "
                         f"positions asked for")
