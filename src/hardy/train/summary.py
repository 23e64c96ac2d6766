"""What `hardy train` ends with: the run's totals, as the last lines and summary.json give them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunSummary:
    steps: int
    final_loss: float
    tokens: int
    wall_s: float
    tokens_per_s: float
    peak_mem_bytes: int
    skipped_steps: int
    checkpoint: str | None
    rollbacks: int = 0

    def lines(self) -> list[str]:
        if self.tokens == 0:  # resumed from a checkpoint at the last step: nothing was left to train
            return [f"nothing left to train: step {self.steps} is the last",
                    f"last checkpoint: {self.checkpoint or 'none'}"]
        return [f"finished {self.steps} steps in {self.wall_s:.1f} s: final loss {self.final_loss:.4f}, "
                f"{self.tokens:,} tokens ({self.tokens_per_s:,.0f} tokens/s), peak memory "
                f"{self.peak_mem_bytes / 2**20:.1f} MiB, {self.skipped_steps} skipped step(s), "
                f"{self.rollbacks} rollback(s)",
                f"last checkpoint: {self.checkpoint or 'none'}"]
