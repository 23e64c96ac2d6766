"""Packed, shuffled, data-parallel-sharded batches with exact resume.

The token stream is cut into non-overlapping samples of seq_len + 1 tokens (inputs and shifted
targets). Epoch e visits the samples in the order of a permutation seeded by (seed, e); the
epochs are concatenated into one endless sample stream. A step takes the next
G = dp * grad_accum * micro_batch samples of that stream; micro-step m of data-parallel rank r
takes the slice starting at base + ((s * grad_accum + m) * dp + r) * micro_batch, s counting
steps since `base`. So a run with dp = 2 and a run with dp = 1, grad_accum = 2 see the same
samples in every optimizer step, and the whole position is one integer shared by every rank:
the global sample index the next step starts at. A checkpoint stores that index, so a run
resumed on another number of processes (or another G) continues the stream where it stopped:
nothing repeated, nothing skipped.
"""
from __future__ import annotations

import numpy as np
import torch

from hardy.errors import HardyError


class PackedLoader:
    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, grad_accum: int = 1,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, pin_memory: bool = False):
        self.tokens = tokens
        self.pin_memory = pin_memory  # page-locked batches: a CUDA copy from them is asynchronous
        self.seq_len, self.micro_batch, self.grad_accum = seq_len, micro_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.n_samples = (len(tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise HardyError(f"the data has {len(tokens)} tokens: too few for one sequence of {seq_len + 1}")
        self.base = 0  # global sample index where this process's first step started
        self.consumed = 0  # micro-batches this rank has taken since `base`
        self._perm_epoch, self._perm = -1, None

    @property
    def layout(self) -> dict:
        return {"seq_len": self.seq_len, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "dp_size": self.dp_size, "n_samples": self.n_samples, "seed": self.seed}

    def position(self) -> int:
        """Global samples consumed by all ranks (exact at a step boundary)."""
        return self.base + self.consumed * self.dp_size * self.micro_batch

    def seek(self, position: int) -> None:
        """The next step starts at global sample `position` (a step boundary of whatever layout took it)."""
        self.base, self.consumed = int(position), 0

    def sample_ids(self, micro: int = 0) -> list[int]:
        """The stream indices of micro-batch `consumed + micro` of this rank (epoch * n_samples + slot)."""
        step, m = divmod(self.consumed + micro, self.grad_accum)
        first = self.base + ((step * self.grad_accum + m) * self.dp_size + self.dp_rank) * self.micro_batch
        return list(range(first, first + self.micro_batch))

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:  # host data: never a tensor whose values a step would read back
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_samples, generator=g).tolist(), epoch
        return self._perm

    def _sample(self, q: int) -> np.ndarray:
        epoch, pos = divmod(q, self.n_samples)
        start = self._permutation(epoch)[pos] * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def epoch(self) -> float:
        """Fraction of the data seen so far (global, all ranks)."""
        return self.position() / self.n_samples

    def next_rows(self) -> torch.Tensor:
        """The next micro-batch as one [micro_batch, seq_len + 1] tensor (copy it to the device in one
        piece, then slice inputs and targets there)."""
        batch = self.rows(0)
        self.consumed += 1
        return batch

    def rows(self, micro: int = 0) -> torch.Tensor:
        """Micro-batch `consumed + micro` of this rank, without taking it (live recovery computes other
        ranks' shares by setting `dp_rank`, and takes the step's batches once it commits)."""
        batch = torch.from_numpy(np.stack([self._sample(q) for q in self.sample_ids(micro)]).astype(np.int64))
        return batch.pin_memory() if self.pin_memory else batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.next_rows()
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"position": self.position(), **self.layout}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the layout (processes, batch shape) may differ, the stream
        (tokens per sample, number of samples, shuffling seed) may not."""
        fixed = ("seq_len", "n_samples", "seed")
        changed = [f"{k}: {state.get(k)} -> {getattr(self, k)}" for k in fixed if state.get(k) != getattr(self, k)]
        if changed:
            raise HardyError(f"cannot resume the data loader: its sample stream changed ({', '.join(changed)})")
        if "position" in state:
            self.seek(int(state["position"]))
        else:  # saved before positions were global: micro-batches of this rank, at a step boundary
            self.seek(int(state["consumed"]) * int(state["dp_size"]) * int(state["micro_batch"]))
