"""Hooks around the training step: what acts on a run beside the step's own arithmetic.

Fault injection (hardy.fault.inject.FaultInjector) is the one user today: a hang before a step, a
NaN or a spike multiplied into its loss, a kill after it or while a checkpoint is being written, a
damaged checkpoint after a save. The trainer calls the hooks at those points and knows nothing of
what they do. A hook object implements any of the methods below (the others are skipped).
"""
from __future__ import annotations

from pathlib import Path

import torch

POINTS = ("before_step", "loss", "after_step", "checkpoint_written", "checkpoint_saved")


class StepHooks:
    """Calls each hook object's method at its point, in order.

    before_step(step)          before the step's first micro-batch (`step` = the step being taken)
    loss(step, loss) -> loss   each micro-batch's loss, before backward
    after_step(step)           after the optimizer step (`step` = the step just taken)
    checkpoint_written(step)   a checkpoint's files are on disk, its completion marker not yet
    checkpoint_saved(path, step, is_main)  a checkpoint is complete
    """

    def __init__(self, hooks: list):
        self._by_point = {point: [getattr(h, point) for h in hooks if hasattr(h, point)] for point in POINTS}

    def before_step(self, step: int) -> None:
        for fn in self._by_point["before_step"]:
            fn(step)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for fn in self._by_point["loss"]:
            loss = fn(step, loss)
        return loss

    def after_step(self, step: int) -> None:
        for fn in self._by_point["after_step"]:
            fn(step)

    def checkpoint_written(self, step: int) -> None:
        for fn in self._by_point["checkpoint_written"]:
            fn(step)

    def checkpoint_saved(self, path: Path, step: int, is_main: bool) -> None:
        for fn in self._by_point["checkpoint_saved"]:
            fn(path, step, is_main)
