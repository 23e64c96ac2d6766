"""The serving engine: one thread owns the model and batches every running request's next token
into one forward pass (continuous batching), so concurrent clients share each read of the weights.

Each request gets a slot of a static KV cache [max_batch, ...]: its prompt is prefilled alone into
that slot, then every decode step feeds one token per active slot at that slot's own position
(`Transformer.hidden_states` with a positions tensor; a per-row mask keeps rows apart). A request
leaves at a stop token or its max_tokens and its slot takes the next waiting request.

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


def context_length(model, requested: int | None) -> int:
    """KV cache length per request: as asked, at most (and by default) the model's own."""
    return min(requested or model.cfg.max_seq_len, model.cfg.max_seq_len)


class ModelRunner:
    """The forward passes the engine makes, over a static KV cache of `max_batch` rows. Under
    `serve --tp` a subclass announces each pass to the other ranks first (hardy.serve.tensor_parallel)."""

    processes = 1  # how many processes each forward pass runs on
    fatal = False  # set when a failed pass leaves the runner unusable (tensor parallel)

    def __init__(self, model, max_batch: int, context: int):
        self.model = model
        self._faults = _faults_from_env()
        self._passes = {"prefill": 0, "decode": 0}
        self.device = compute_device(model)
        model.setup_kv_cache(max_batch, context)
        self._caches = [layer.attention.kv_cache for layer in model.layers]

    def _maybe_fail(self, kind: str) -> None:
        self._passes[kind] += 1
        if (kind, self._passes[kind]) in self._faults:
            raise InjectedFault(f"injected fault in {kind} pass {self._passes[kind]} (HARDY_SERVE_FAULT)")

    @torch.inference_mode()
    def prefill(self, row: int, prompt: torch.Tensor) -> torch.Tensor:
        """Fill cache row `row` with `prompt` [1, L]; the logits after its last token [V]."""
        self._maybe_fail("prefill")
        for layer, cache in zip(self.model.layers, self._caches):
            layer.attention.kv_cache = cache.rows(row, row + 1)
        try:
            return self.model.logits(self.model.hidden_states(prompt.to(self.device), 0)[0, -1])
        finally:
            for layer, cache in zip(self.model.layers, self._caches):
                layer.attention.kv_cache = cache

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row (tokens [n, 1] at positions [n]) for cache rows 0..n-1; logits [n, V]."""
        self._maybe_fail("decode")
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        return self.model.logits(decode_hidden(self.model, tokens, positions)[:, -1])

    @torch.inference_mode()
    def score_batch(self, tokens: torch.Tensor, at: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """One batch of scoring rows (hardy.infer.rerank.batch_tensors), outside the KV cache: the
        caches are detached for the pass, so no slot's keys and values are touched."""
        for layer in self.model.layers:
            layer.attention.kv_cache = None
        try:
            return target_log_likelihood(self.model, tokens.to(self.device), at.to(self.device),
                                         targets.to(self.device), mask.to(self.device))
        finally:
            for layer, cache in zip(self.model.layers, self._caches):
                layer.attention.kv_cache = cache

    def idle(self) -> None:
        """Called while nothing runs."""

    def finish(self) -> None:
        self.model.clear_kv_cache()


class Engine:
    def __init__(self, model, max_batch: int = 8, max_queue: int = 64, context: int | None = None,
                 runner: type[ModelRunner] = ModelRunner, score_batch: int = 16):
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
        self.runner = runner(model, max_batch, self.context)
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
        return sum(s is not None for s in self.slots) + self.waiting.qsize() + self.scoring.qsize()

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
            req.events.put(("done", "stop" if stop else "length"))
            self.slots[slot_index] = None
            return True
        return False

    def _prefill(self, slot_index: int, req: Request) -> None:
        if req.cancelled:
            req.events.put(("done", "cancelled"))
            return
        try:
            logits = self.runner.prefill(slot_index, torch.tensor([req.prompt]))
        except Exception as e:  # this request fails; the others are untouched (unless the runner is fatal)
            req.events.put(("error", f"{type(e).__name__}: {e}"))
            if self.runner.fatal:
                raise
            return
        self.slots[slot_index] = _Slot(req, position=len(req.prompt), last=0)
        token = sample(logits, req.sampling, req.generator)
        if not self._emit(slot_index, token):
            self.slots[slot_index].last = token

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
                self.slots[i] = None
        active = [i for i, s in enumerate(self.slots) if s is not None]
        if not active:
            return
        n = max(active) + 1  # rows 0 .. n-1 (an empty row in between computes and is ignored)
        tokens = torch.zeros(n, 1, dtype=torch.long)
        positions = torch.zeros(n, dtype=torch.long)
        for i in active:
            tokens[i, 0], positions[i] = self.slots[i].last, self.slots[i].position
        logits = self.runner.decode(tokens, positions).cpu()  # one copy back per step, not one per row
        self.largest_batch = max(self.largest_batch, len(active))
        self.steps += 1
        for i in active:
            slot = self.slots[i]
            token = sample(logits[i], slot.request.sampling, slot.request.generator)
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

    def _serve_loop(self) -> None:
        while not self._stop.is_set():
            if not self.accepting and self.waiting.empty() and self.scoring.empty() and not any(self.slots):
                self._drained.set()  # nothing queued, nothing held, and nothing more can arrive
            try:
                self._score_waiting()
                for i in range(self.max_batch):  # admit waiting requests into free slots
                    if self.slots[i] is None and not self.waiting.empty():
                        self._prefill(i, self.waiting.get_nowait())
                if any(s is not None for s in self.slots):
                    self._decode_step()
                elif self.waiting.empty() and self.scoring.empty():
                    if not self._wake.wait(0.05):
                        self.runner.idle()
                    self._wake.clear()  # a submission after this is still seen: the queues are read next
            except Exception as e:  # a failing forward must not strand clients: fail what is running
                reason = f"{type(e).__name__}: {e}"
                if self.runner.fatal:
                    self._fail_everything(reason)
                    return
                self._fail_running(reason)
