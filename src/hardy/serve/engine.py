"""The serving engine: one thread owns the model and batches every running request's next token
into one forward pass (continuous batching), so concurrent clients share each read of the weights.

Each request gets one of `max_batch` sequences of the paged KV cache (hardy.infer.kv): its prompt is
prefilled into that sequence's blocks, whole by default, or in chunks (`prefill_chunk`, `ChunkPolicy`):
while other streams decode, each chunk rides along in their decode step as extra rows at consecutive
positions, so a long prompt being admitted keeps them stepping instead of stopping them for the whole
prompt (chunked prefill); with none decoding, it goes in by passes of its own. Every decode step feeds one token per active sequence at
its own position (`Transformer.hidden_states` with a positions tensor; a per-row mask keeps rows apart), the
blocks taken as the tokens arrive; with a speculator (hardy.infer.speculate) a greedy stream also feeds
guessed tokens after its own, kept while the model agrees (`_take`). A request leaves at a stop token or
its max_tokens, its blocks go back to the pool and its slot takes the next waiting request — once the pool can hold all that request may grow to
(a pool smaller than max_batch x context, where memory is short, makes requests wait, never fail halfway).

Scoring requests (`POST /v1/rerank`: candidate rows whose continuation's log-likelihood is wanted)
need no cache slot: every iteration, all that wait are scored together in batches between two decode
steps of the running generations, over the same weights.

A forward pass that raises fails the requests it was for (their clients get a 500) and the engine
serves on. Under `serve --tp` it cannot: the other ranks are left inside that pass's collectives, so
the runner declares itself `fatal`, every request is failed and the engine stops (`failed` says why).
(The serving tests make passes fail through a start-up hook of their own, tests/fault_hooks.)
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from hardy.devices import compute_device
from hardy.errors import HardyError
from hardy.infer.fused_decode import decode_hidden
from hardy.infer.generate import MIN_TEMPERATURE, SamplingConfig, sample
from hardy.infer.kv import BLOCK, PagedKVCache
from hardy.infer.rerank import ScoreRow, score_rows, target_log_likelihood
from hardy.infer.speculate import kept_tokens


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class EngineFailed(Exception):
    pass


@dataclass
class Request:
    prompt: list[int]
    sampling: SamplingConfig
    stop_ids: set[int]
    id: int = field(default_factory=itertools.count().__next__)
    events: "queue.Queue" = field(default_factory=queue.Queue)  # ("token", id) ... then ("done", reason)
    created: float = field(default_factory=time.time)
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (the API cuts the text; see cancel)
    cancelled: bool = False  # set by any thread; the engine thread frees the slot at its next step


@dataclass
class ScoreRequest:
    """Rows whose target log-likelihood is wanted (one rerank request's candidates). Its events: one
    ("scores", [float per row]) or ("error", reason)."""
    rows: list[ScoreRow]
    pad_id: int
    id: int = field(default_factory=itertools.count().__next__)
    events: "queue.Queue" = field(default_factory=queue.Queue)
    created: float = field(default_factory=time.time)


@dataclass
class _Slot:
    request: Request
    position: int  # where the next fed token goes
    last: int  # the token to feed next
    prefilled: int = 0  # prompt tokens in the cache so far; it decodes once all are

    @property
    def left(self) -> int:
        """Prompt tokens not yet in the cache."""
        return len(self.request.prompt) - self.prefilled

    @property
    def decoding(self) -> bool:
        return self.left == 0


RIDE_FIRST, RIDE_MIN, RIDE_MAX, IDLE_CHUNK = 2, 1, 256, 512  # prompt tokens per step or pass
RIDE_SHARE = 0.6  # auto: a step carrying prompt rows may take this much longer than one without
EMA = 0.3


class ChunkPolicy:
    """How many prompt tokens go in per engine iteration. While streams decode, the tokens ride along in
    their decode step (extra rows: the weights are read once for both); alone, a prompt goes in by passes
    of its own. `chunk` 0: whole prompts, each in a pass of its own; N: N tokens at most; None (auto): the
    riding rows grow while a step carrying them stays within (1 + RIDE_SHARE) x a plain step and shrink
    when it does not (RIDE_MIN..RIDE_MAX: what a row costs is not linear, and it grows with the position
    it attends from), and IDLE_CHUNK per pass when nothing decodes."""

    def __init__(self, chunk: int | None):
        if chunk is not None and chunk < 0:
            raise HardyError(f"the prefill chunk must be >= 0 tokens (got {chunk})")
        self.fixed = chunk
        self.step_s: float | None = None  # a decode step with no prompt rows, smoothed
        self.ride = RIDE_FIRST

    def observe_step(self, seconds: float, prompt_rows: int) -> None:
        if not prompt_rows:
            self.step_s = seconds if self.step_s is None else (1 - EMA) * self.step_s + EMA * seconds
        elif self.step_s is not None:
            if seconds <= (1 + RIDE_SHARE) * self.step_s:
                self.ride = min(RIDE_MAX, self.ride + max(1, self.ride // 4))
            else:
                self.ride = max(RIDE_MIN, self.ride * 3 // 4)

    def tokens(self, decoding: bool) -> int | None:
        """This iteration's prompt tokens: riding a decode step (`decoding`) or in a pass; None: no limit."""
        if self.fixed is not None:
            return self.fixed or None
        return self.ride if decoding else IDLE_CHUNK


DEFAULT_CONTEXT = 4096  # llama-server's default too: a file's 128k maximum is not a per-request budget


def context_length(model, requested: int | None) -> int:
    """KV cache length per request: as asked (at most the model's own), by default the model's own
    up to DEFAULT_CONTEXT."""
    return min(requested or DEFAULT_CONTEXT, model.cfg.max_seq_len)


class ModelRunner:
    """The forward passes the engine makes, over a paged KV cache of `max_batch` sequences of up to
    `context` positions (`capacity` tokens in all; default: every sequence full). Under `serve --tp` a
    subclass announces each pass to the other ranks first (hardy.serve.tensor_parallel)."""

    processes = 1  # how many processes each forward pass runs on
    fatal = False  # set when a failed pass leaves the runner unusable (tensor parallel)

    def __init__(self, model, max_batch: int, context: int, kv_dtype: torch.dtype = torch.bfloat16,
                 capacity: int | None = None):
        self.model = model
        self.device = compute_device(model)
        self.cache = PagedKVCache(model, max_batch, context, kv_dtype, capacity)
        self.pool = self.cache.pool
        self._layers = [layer.attention.kv_cache for layer in model.layers]
        self.promised = [0] * max_batch  # blocks each sequence may still grow to (admission)

    def fits(self, tokens: int) -> bool:
        """Can a sequence of up to `tokens` positions start now without the pool running out later?"""
        return sum(self.promised) + -(-tokens // BLOCK) <= self.pool.capacity

    @torch.inference_mode()
    def prefill(self, row: int, prompt: torch.Tensor, budget: int | None = None, start: int = 0) -> torch.Tensor:
        """Write `prompt` [1, L] into sequence `row` at positions start.. (start 0: a new sequence, which
        may grow to `budget` positions; later chunks continue it); the logits after its last token [V]."""
        if start == 0:
            self.pool.release(row)  # a follower learns of a finished sequence here
            self.promised[row] = -(-(budget or prompt.shape[1]) // BLOCK)
        self.pool.reserve(row, start + prompt.shape[1])
        self.cache.use([row])
        return self.model.logits(self.model.hidden_states(prompt.to(self.device), start)[0, -1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int],
               want: list[int] | None = None) -> torch.Tensor:
        """One token per row (tokens [n, 1] at positions [n]) of sequences `rows`; the logits of the batch
        rows `want` (default all) [len(want), V]. A sequence may fill several rows (prompt tokens riding
        along at consecutive positions): each row sees the keys up to its own position."""
        for row, position in zip(rows, positions.tolist()):
            self.pool.reserve(row, position + 1)
        self.cache.use(rows)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        hidden = decode_hidden(self.model, tokens, positions)[:, -1]
        return self.model.logits(hidden if want is None else hidden[want])

    def promise(self, row: int, tokens: int) -> None:
        """Sequence `row` is admitted and may grow to `tokens` positions (what `fits` counts)."""
        self.promised[row] = -(-tokens // BLOCK)

    def release(self, row: int) -> None:
        """Sequence `row` has ended: its blocks go back to the pool."""
        self.pool.release(row)
        self.promised[row] = 0

    @torch.inference_mode()
    def score_batch(self, tokens: torch.Tensor, at: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """One batch of scoring rows (hardy.infer.rerank.batch_tensors), outside the KV cache: the
        caches are detached for the pass, so no sequence's keys and values are touched."""
        for layer in self.model.layers:
            layer.attention.kv_cache = None
        try:
            return target_log_likelihood(self.model, tokens.to(self.device), at.to(self.device),
                                         targets.to(self.device), mask.to(self.device))
        finally:
            for layer, view in zip(self.model.layers, self._layers):
                layer.attention.kv_cache = view

    def idle(self) -> None:
        """Called while nothing runs."""

    def finish(self) -> None:
        self.model.clear_kv_cache()


class Engine:
    def __init__(self, model, max_batch: int = 8, max_queue: int = 64, context: int | None = None,
                 runner: type[ModelRunner] = ModelRunner, score_batch: int = 16,
                 kv_dtype: torch.dtype = torch.bfloat16, capacity: int | None = None,
                 prefill_chunk: int | None = 0, speculator=None):
        self.max_batch = max_batch
        self.speculator = speculator  # hardy.infer.speculate.Speculator: guesses checked for greedy requests
        self.chunks = ChunkPolicy(prefill_chunk)
        self.admitted: list[int] = []  # slots still prefilling, in admission order
        self.score_batch = score_batch  # scoring rows per forward pass
        self.context = context_length(model, context)
        self.waiting: queue.Queue = queue.Queue(maxsize=max_queue)
        self.scoring: queue.Queue = queue.Queue(maxsize=max_queue)
        self._wake = threading.Event()  # set on every submission: an idle engine starts at once
        self.score_passes = 0
        self.slots: list[_Slot | None] = [None] * max_batch
        self.accepting = True
        self.largest_batch = 0  # the most requests decoded together so far (observable by tests)
        self.steps = 0
        self.failed: str | None = None  # why the engine stopped for good (a fatal runner failure)
        self._stop = threading.Event()
        # Submissions and the end of admission are ordered by this lock, and only the engine thread
        # (which owns the hand-over from queue to slot) declares the drain complete: no request can
        # be between the two and get lost.
        self._admission = threading.Lock()
        self._drained = threading.Event()
        self.runner = runner(model, max_batch, self.context, kv_dtype, capacity)
        self._next: Request | None = None  # taken from the queue, waiting for KV blocks
        self._thread = threading.Thread(target=self._loop, name="hardy-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, request: Request | ScoreRequest) -> Request | ScoreRequest:
        if isinstance(request, Request) and request.sampling.seed is not None:
            request.generator = torch.Generator().manual_seed(request.sampling.seed)
        with self._admission:
            if self.failed:
                raise EngineFailed(self.failed)
            if not self.accepting:
                raise ShuttingDown()
            try:
                (self.scoring if isinstance(request, ScoreRequest) else self.waiting).put_nowait(request)
            except queue.Full:
                raise QueueFull() from None
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        """Stop generating for `request` (a stop string was seen, or its client left)."""
        request.cancelled = True

    @property
    def busy(self) -> int:
        return (sum(s is not None for s in self.slots) + self.waiting.qsize() + self.scoring.qsize()
                + (self._next is not None))

    def drain(self, timeout: float) -> bool:
        """Stop accepting; wait up to `timeout` s for queued and running requests. True if all finished."""
        with self._admission:
            self.accepting = False
        return self._drained.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)  # the engine thread finishes the runner (all forwards stay on it)

    # ------------------------------------------------------------------ the engine thread
    def _emit(self, slot_index: int, token: int) -> bool:
        """Record a new token; True when the request is finished (and its slot freed)."""
        slot = self.slots[slot_index]
        req = slot.request
        req.tokens.append(token)
        stop = token in req.stop_ids
        if not stop:
            req.events.put(("token", token))
        if stop or len(req.tokens) >= req.sampling.max_new_tokens:
            self._free(slot_index)  # before the client hears "done": a scrape after its answer sees the slot free
            req.events.put(("done", "stop" if stop else "length"))
            return True
        return False

    def _free(self, slot_index: int) -> None:
        self.slots[slot_index] = None
        if slot_index in self.admitted:  # cancelled or failed while its prompt was going in
            self.admitted.remove(slot_index)
        self.runner.release(slot_index)
        if self.speculator is not None:
            self.speculator.release(slot_index)

    def _prefill_some(self) -> None:
        """Admitted prompts by passes of their own (nothing decodes, or `prefill_chunk` 0), the fewest
        tokens left first, up to this iteration's budget."""
        self._end_cancelled()
        budget = self.chunks.tokens(decoding=False)
        for i in self._prefill_order():
            if budget is not None and budget <= 0:
                return
            slot = self.slots[i]
            req = slot.request
            n = slot.left if budget is None else min(budget, slot.left)
            try:
                logits = self.runner.prefill(i, torch.tensor([req.prompt[slot.prefilled:slot.prefilled + n]]),
                                             len(req.prompt) + req.sampling.max_new_tokens, slot.prefilled)
            except Exception as e:  # this request fails; the others are untouched (unless the runner is fatal)
                req.events.put(("error", f"{type(e).__name__}: {e}"))
                self._free(i)
                if self.runner.fatal:
                    raise
                continue
            budget = None if budget is None else budget - n
            self._prefilled(i, n, logits)

    def _prefill_order(self) -> list[int]:
        """The admitted slots still prefilling, the fewest prompt tokens left first (a short prompt never
        waits behind a long one; sorted() keeps admission order on ties)."""
        return sorted(self.admitted, key=lambda i: self.slots[i].left)

    def _prefilled(self, i: int, n: int, logits: torch.Tensor) -> None:
        """`n` more prompt tokens of slot `i` are in; after its last, its first token (`logits`)."""
        slot = self.slots[i]
        slot.prefilled += n
        if slot.decoding:
            self.admitted.remove(i)
            slot.position = len(slot.request.prompt)
            token = sample(logits, slot.request.sampling, slot.request.generator)
            if not self._emit(i, token):
                slot.last = token

    def _admit(self) -> None:
        """Waiting requests into free slots, in order, each once the KV pool can hold all it may grow to
        (never: more than `capacity`; the server refuses such a request up front). Their prompts are
        prefilled by `_prefill_some`."""
        for i in range(self.max_batch):
            if self.slots[i] is not None:
                continue
            if self._next is None:
                if self.waiting.empty():
                    return
                self._next = self.waiting.get_nowait()
            req = self._next
            if not self.runner.fits(len(req.prompt) + req.sampling.max_new_tokens) and any(self.slots):
                return  # wait for running sequences to free blocks
            self._next = None
            if req.cancelled:
                req.events.put(("done", "cancelled"))
                continue
            self.runner.promise(i, len(req.prompt) + req.sampling.max_new_tokens)
            self.slots[i] = _Slot(req, position=0, last=0)
            self.admitted.append(i)

    def _score_waiting(self) -> None:
        """Every waiting scoring request's rows, together in batches of `score_batch`."""
        requests = []
        while True:
            try:
                requests.append(self.scoring.get_nowait())
            except queue.Empty:
                break
        if not requests:
            return
        rows = [row for r in requests for row in r.rows]
        pad = requests[0].pad_id
        try:
            scores = score_rows(None, rows, self.score_batch, pad, run=self.runner.score_batch)
        except Exception as e:
            for r in requests:
                r.events.put(("error", f"{type(e).__name__}: {e}"))
            if self.runner.fatal:
                raise
            return
        self.score_passes += -(-len(rows) // self.score_batch)
        for r in requests:
            r.events.put(("scores", scores[:len(r.rows)]))
            scores = scores[len(r.rows):]

    def _end_cancelled(self) -> None:
        """Free the slots of cancelled requests, decoding or still prefilling."""
        for i, s in enumerate(self.slots):
            if s is not None and s.request.cancelled:
                s.request.events.put(("done", "cancelled"))
                self._free(i)

    def _guesses(self, active: list[int]) -> dict[int, list[int]]:
        """The speculator's guesses for the greedy streams among `active` (none past a request's
        max_tokens: the last row's logits give its final token)."""
        if self.speculator is None:
            return {}
        contexts = {}
        for i in active:
            req = self.slots[i].request
            room = req.sampling.max_new_tokens - len(req.tokens) - 1
            if room > 0 and req.sampling.temperature < MIN_TEMPERATURE:
                contexts[i] = (req.prompt + req.tokens, room)
        return self.speculator.propose(contexts, len(active)) if contexts else {}

    def _decode_step(self) -> None:
        self._end_cancelled()
        active = [i for i, s in enumerate(self.slots) if s is not None and s.decoding]
        if not active:
            return
        guesses = self._guesses(active)
        tokens, positions, rows, want = [], [], [], []
        for i in active:  # each stream's next token, then its guesses at the positions after it
            slot = self.slots[i]
            fed = [slot.last] + guesses.get(i, [])
            want += range(len(rows), len(rows) + len(fed))
            tokens += fed
            positions += range(slot.position, slot.position + len(fed))
            rows += [i] * len(fed)
        guessed, riding = len(rows) - len(active), []
        budget = self.chunks.tokens(decoding=True)
        for i in self._prefill_order() if self.chunks.fixed != 0 else ():  # prompt chunks ride along
            if budget is not None and budget <= 0:
                break
            slot = self.slots[i]
            start = slot.prefilled
            n = slot.left if budget is None else min(budget, slot.left)
            tokens += slot.request.prompt[start:start + n]
            positions += range(start, start + n)
            rows += [i] * n
            budget = None if budget is None else budget - n
            done = n == slot.left
            if done:
                want.append(len(rows) - 1)  # its last prompt token: the logits of its first new token
            riding.append((i, n, len(want) - 1 if done else None))
        t0 = time.perf_counter()
        logits = self.runner.decode(torch.tensor(tokens, dtype=torch.long)[:, None],
                                    torch.tensor(positions, dtype=torch.long), rows, want)
        logits = logits.cpu()  # one copy back per step, not one per row
        seconds, prompt_rows = time.perf_counter() - t0, len(rows) - len(active) - guessed
        if not guessed:
            self.chunks.observe_step(seconds, prompt_rows)
        if self.speculator is not None and not prompt_rows:
            self.speculator.observe_step(seconds, len(active), guessed)
        self.largest_batch = max(self.largest_batch, len(active))
        self.steps += 1
        for i, n, at in riding:
            self._prefilled(i, n, None if at is None else logits[at])
        row = 0
        for i in active:
            row += self._take(i, logits[row:], guesses.get(i, []))

    def _take(self, i: int, logits: torch.Tensor, guesses: list[int]) -> int:
        """Slot i's new tokens from its rows' logits (`kept_tokens`); returns how many rows slot i had."""
        slot = self.slots[i]
        req = slot.request
        taken = kept_tokens(logits, guesses, lambda row: sample(row, req.sampling, req.generator))
        for token in taken:
            slot.position += 1
            if self._emit(i, token):
                return len(guesses) + 1  # finished: its slot, and the speculator's state for it, released
            slot.last = token
        if guesses:
            self.speculator.verified(i, len(guesses), len(taken) - 1)
        return len(guesses) + 1

    def _loop(self) -> None:
        try:
            self._serve_loop()
        except BaseException as e:  # nothing may wait forever on an engine that has stopped
            self._fail_everything(f"{type(e).__name__}: {e}")
            raise
        finally:
            self.runner.finish()

    def _fail_everything(self, reason: str) -> None:
        with self._admission:
            self.failed = self.failed or reason
            self.accepting = False
        self._fail_running(reason)
        if self._next is not None:
            self._next.events.put(("error", f"the engine stopped: {reason}"))
            self._next = None
        for waiting in (self.waiting, self.scoring):
            while True:
                try:
                    waiting.get_nowait().events.put(("error", f"the engine stopped: {reason}"))
                except queue.Empty:
                    break
        self._drained.set()

    def _fail_running(self, reason: str) -> None:
        self.admitted.clear()
        for i, s in enumerate(self.slots):
            if s is not None:
                s.request.events.put(("error", reason))
                self.slots[i] = None
                self.runner.pool.release(i)
                self.runner.promised[i] = 0
                if self.speculator is not None:
                    self.speculator.release(i)

    def _serve_loop(self) -> None:
        while not self._stop.is_set():
            if (not self.accepting and self.waiting.empty() and self.scoring.empty() and not any(self.slots)
                    and self._next is None):
                self._drained.set()  # nothing queued, nothing held, and nothing more can arrive
            try:
                self._score_waiting()
                self._admit()
                if any(s is not None and s.decoding for s in self.slots):
                    if self.chunks.fixed == 0:  # unchunked: whole prompts first, in passes of their own
                        self._prefill_some()
                    self._decode_step()  # the running streams' next tokens, prompt chunks riding along
                elif any(s is not None for s in self.slots):
                    self._prefill_some()
                elif self.waiting.empty() and self.scoring.empty() and self._next is None:
                    if not self._wake.wait(0.05):
                        self.runner.idle()
                    self._wake.clear()  # a submission after this is still seen: the queues are read next
            except Exception as e:  # a failing forward must not strand clients: fail what is running
                reason = f"{type(e).__name__}: {e}"
                if self.runner.fatal:
                    self._fail_everything(reason)
                    return
                self._fail_running(reason)
