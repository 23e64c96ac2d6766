"""`hardy serve --tp N`: rank 0 runs the HTTP server and the engine; every other rank holds its
slice of the model and repeats each forward pass rank 0 makes, told what to run by a broadcast.

Only forward passes cross processes: before each one, rank 0's engine thread broadcasts a header
(what, which cache row / how many rows, prompt length / row width, scored tokens per row) and then
the token ids (and, for a scoring pass, the scored positions, targets and mask), so all ranks enter
the same collectives in the same order. Logits come out replicated and only rank 0 samples. While
idle, rank 0 sends a keep-alive now and then, so the followers' waiting broadcast never reaches
the process group's timeout. The followers ignore SIGTERM/SIGINT: rank 0 drains and then tells
them to stop.

A pass that raises on rank 0 after its announcement leaves the followers inside that pass's
collectives, where no STOP can reach them: the runner turns `fatal`, rank 0 fails every request and
exits, and its closed gloo connections end the followers' waiting collectives, so they exit too
(`follow` returns False) instead of waiting out the process group's timeout.
"""
from __future__ import annotations

import dataclasses
import signal
import time

import torch
import torch.distributed as dist

from hardy.serve.engine import ModelRunner

PREFILL, DECODE, KEEPALIVE, STOP, SCORE, RELEASE = range(6)
KEEPALIVE_S = 10.0  # far below the process group's timeout (hardy.parallel.distributed: 600 s)


def agree_on_capacity(budget):
    """Every rank's pool holds what the smallest can: the leader admits requests for all of them."""
    capacity = torch.tensor([budget.capacity], dtype=torch.long)
    dist.all_reduce(capacity, op=dist.ReduceOp.MIN)
    return dataclasses.replace(budget, capacity=int(capacity))


class LeaderRunner(ModelRunner):
    """Rank 0: announce, then run the pass like a single process would."""

    def __init__(self, model, max_batch: int, context: int, kv_dtype: torch.dtype = torch.bfloat16,
                 capacity: int | None = None):
        super().__init__(model, max_batch, context, kv_dtype, capacity)
        self.processes = dist.get_world_size()
        self._last = time.monotonic()

    def _announce(self, op: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0,
                  tensors: tuple[torch.Tensor, ...] = ()) -> None:
        dist.broadcast(torch.tensor([op, a, b, c, d], dtype=torch.long), src=0)
        for tensor in tensors:
            dist.broadcast(tensor.contiguous(), src=0)
        self._last = time.monotonic()

    def prefill(self, row: int, prompt: torch.Tensor, budget: int | None = None, start: int = 0) -> torch.Tensor:
        try:
            self._announce(PREFILL, row, prompt.shape[1], budget or 0, start, tensors=(prompt,))
            return super().prefill(row, prompt, budget, start)
        except Exception:
            self.fatal = True
            raise

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, rows: list[int],
               want: list[int] | None = None) -> torch.Tensor:
        want = list(range(tokens.shape[0])) if want is None else want
        try:
            self._announce(DECODE, tokens.shape[0], len(want), tensors=(
                torch.cat([tokens[:, 0], positions, torch.tensor(rows + want, dtype=torch.long)]),))
            return super().decode(tokens, positions, rows, want)
        except Exception:
            self.fatal = True
            raise

    def release(self, row: int) -> None:
        if not self.fatal:
            self._announce(RELEASE, row)
        super().release(row)

    def score_batch(self, tokens: torch.Tensor, at: torch.Tensor, targets: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        try:
            self._announce(SCORE, tokens.shape[0], tokens.shape[1], at.shape[1],
                           tensors=(tokens, torch.stack([at, targets, mask.long()])))
            return super().score_batch(tokens, at, targets, mask)
        except Exception:
            self.fatal = True
            raise

    def idle(self) -> None:
        if time.monotonic() - self._last > KEEPALIVE_S:
            self._announce(KEEPALIVE)

    def finish(self) -> None:
        if not self.fatal:  # a fatal failure: the followers are in a collective and only our exit frees them
            self._announce(STOP)
        super().finish()


def follow(model, max_batch: int, context: int, kv_dtype: torch.dtype = torch.bfloat16,
           capacity: int | None = None) -> bool:
    """Ranks 1..N-1: repeat rank 0's forward passes until it says stop (True), or until rank 0 is gone
    (False: a collective failed because its connections closed)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 decides when serving ends
    runner = ModelRunner(model, max_batch, context, kv_dtype, capacity)
    try:
        while True:
            header = torch.empty(5, dtype=torch.long)
            dist.broadcast(header, src=0)
            op, a, b, c, d = header.tolist()
            if op == PREFILL:
                prompt = torch.empty(1, b, dtype=torch.long)
                dist.broadcast(prompt, src=0)
                runner.prefill(a, prompt, c or None, d)
            elif op == DECODE:
                flat = torch.empty(3 * a + b, dtype=torch.long)
                dist.broadcast(flat, src=0)
                runner.decode(flat[:a, None], flat[a:2 * a], flat[2 * a:3 * a].tolist(), flat[3 * a:].tolist())
            elif op == RELEASE:
                runner.release(a)
            elif op == SCORE:
                tokens, extra = torch.empty(a, b, dtype=torch.long), torch.empty(3, a, c, dtype=torch.long)
                dist.broadcast(tokens, src=0)
                dist.broadcast(extra, src=0)
                runner.score_batch(tokens, extra[0], extra[1], extra[2].bool())
            elif op == STOP:
                return True
    except RuntimeError:  # gloo: "Connection closed by peer" and the like
        return False
    finally:
        runner.finish()
