"""The serving engine: one thread owns the model and batches every running request's next token
into one forward pass (continuous batching), so concurrent clients share each read of the weights.

Each request gets one of `max_batch` sequences of the paged KV cache (hardy.infer.kv): its prompt is
prefilled alone into that sequence's blocks, then every decode step feeds one token per active sequence at
its own position (`Transformer.hidden_states` with a positions tensor; a per-row mask keeps rows apart), the
blocks taken as the tokens arrive. A request leaves at a stop token or its max_tokens, its blocks go back to
the pool and its slot takes the next waiting request — once the pool can hold all that request may grow to
(a pool smaller than max_batch x context, where memory is short, makes requests wait, never fail halfway).

Scoring requests (`POST /v1/rerank`: candidate rows whose continuation's log-likelihood is wanted)
need no cache slot: every iteration, all that wait are scored together in batches between two decode
steps of the running generations, over the same weights.

A forward pass that raises fails the requests it was for (their clients get a 500) and the engine
serves on. Under `serve --tp` it cannot: the other ranks are left inside that pass's collectives, so
the runner declares itself `fatal`, every request is failed and the engine stops (`failed` says why).
`HARDY_SERVE_FAULT="prefill@N,decode@M"` makes the N-th prefill and the M-th decode pass raise, to
test all this.
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from hardy.devices import compute_device
from hardy.errors import HardyError
from hardy.infer.fused_decode import decode_hidden
from hardy.infer.generate import SamplingConfig, sample
from hardy.infer.kv import BLOCK, PagedKVCache
from hardy.infer.rerank import ScoreRow, score_rows, target_log_likelihood


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class EngineFailed(Exception):
    pass


class InjectedFault(RuntimeError):
    pass


def _faults_from_env() -> set[tuple[str, int]]:
    spec = os.environ.get("HARDY_SERVE_FAULT", "")
    faults = set()
    for item in filter(None, spec.split(",")):
        kind, _, n = item.strip().partition("@")
        if kind not in ("prefill", "decode") or not n.isdigit() or int(n) < 1:
            raise HardyError(f"HARDY_SERVE_FAULT={spec!r}: expected prefill@N or decode@N (N >= 1), comma-separated")
        faults.add((kind, int(n)))
    return faults


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
        self._faults = _faults_from_env()
        self._passes = {"prefill": 0, "decode": 0}
        self.device = compute_device(model)
        self.cache = PagedKVCache(model, max_batch, context, kv_dtype, capacity)
        self.pool = self.cache.pool
        self._layers = [layer.attention.kv_cache for layer in model.layers]
        self.promised = [0] * max_batch  # blocks each sequence may still grow to (admission)

    def _maybe_fail(self, kind: str) -> None:
        self._passes[kind] += 1
        if (kind, self._passes[kind]) in self._faults:
            raise InjectedFault(f"injected fault in {kind} pass {self._passes[kind]} (HARDY_SERVE_FAULT)")

    def fits(self, tokens: int) -> bool:
        """Can a sequence of up to `tokens` positions start now without the pool running out later?"""
        return sum(self.promised) + -(-tokens // BLOCK) <= self.pool.capacity

    @torch.inference_mode()
    def prefill(self, row: int, prompt: torch.Tensor, budget: int | None = None) -> torch.Tensor:
        """Fill sequence `row` with `prompt` [1, L] (`budget`: the positions it may grow to); the logits
        after its last token [V]."""
        self._maybe_fail("prefill")
        self.pool.release(row)  # a follower learns of a finished sequence here
        self.promised[row] = -(-(budget or prompt.shape[1]) // BLOCK)
        self.pool.reserve(row, prompt.shape[1])
        self.cache.use([row])
        return self.model.logits(self.model.hidden_states(prompt.to(self.device), 0)[0, -1])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One token per row (tokens [n, 1] at positions [n]) of sequences `rows`; logits [n, V]."""
        self._maybe_fail("decode")
        for row, position in zip(rows, positions.tolist()):
            self.pool.reserve(row, position + 1)
        self.cache.use(rows)
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        return self.model.logits(decode_hidden(self.model, tokens, positions)[:, -1])

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
                 kv_dtype: torch.dtype = torch.bfloat16, capacity: int | None = None):
        self.max_batch = max_batch
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
        self.runner.release(slot_index)

    def _prefill(self, slot_index: int, req: Request) -> None:
        if req.cancelled:
            req.events.put(("done", "cancelled"))
            return
        try:
            logits = self.runner.prefill(slot_index, torch.tensor([req.prompt]),
                                         len(req.prompt) + req.sampling.max_new_tokens)
        except Exception as e:  # this request fails; the others are untouched (unless the runner is fatal)
            req.events.put(("error", f"{type(e).__name__}: {e}"))
            self.runner.release(slot_index)
            if self.runner.fatal:
                raise
            return
        self.slots[slot_index] = _Slot(req, position=len(req.prompt), last=0)
        token = sample(logits, req.sampling, req.generator)
        if not self._emit(slot_index, token):
            self.slots[slot_index].last = token

    def _admit(self) -> None:
        """Waiting requests into free slots, in order, each once the KV pool can hold all it may grow to
        (never: more than `capacity`; the server refuses such a request up front)."""
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
            self._prefill(i, req)

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

    def _decode_step(self) -> None:
        for i, s in enumerate(self.slots):
            if s is not None and s.request.cancelled:
                s.request.events.put(("done", "cancelled"))
                self._free(i)
        active = [i for i, s in enumerate(self.slots) if s is not None]
        if not active:
            return
        tokens = torch.tensor([[self.slots[i].last] for i in active], dtype=torch.long)
        positions = torch.tensor([self.slots[i].position for i in active], dtype=torch.long)
        logits = self.runner.decode(tokens, positions, active).cpu()  # one copy back per step, not one per row
        self.largest_batch = max(self.largest_batch, len(active))
        self.steps += 1
        for row, i in enumerate(active):
            slot = self.slots[i]
            token = sample(logits[row], slot.request.sampling, slot.request.generator)
            slot.position += 1
            if not self._emit(i, token):
                slot.last = token

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
        for i, s in enumerate(self.slots):
            if s is not None:
                s.request.events.put(("error", reason))
                self.slots[i] = None
                self.runner.pool.release(i)
                self.runner.promised[i] = 0

    def _serve_loop(self) -> None:
        while not self._stop.is_set():
            if (not self.accepting and self.waiting.empty() and self.scoring.empty() and not any(self.slots)
                    and self._next is None):
                self._drained.set()  # nothing queued, nothing held, and nothing more can arrive
            try:
                self._score_waiting()
                self._admit()
                if any(s is not None for s in self.slots):
                    self._decode_step()
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
