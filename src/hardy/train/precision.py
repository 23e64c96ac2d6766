"""Dynamic loss scaling for fp16 (bf16 and fp32 need none).

The scale multiplies the loss before backward. A step whose gradients overflow (non-finite
global norm, checked on all ranks) is skipped and the scale halves; after `growth_interval`
good steps in a row it doubles. The same global-norm check serves NaN detection in every dtype.
"""
from __future__ import annotations


class LossScaler:
    def __init__(self, enabled: bool, init_scale: float = 65536.0, growth_interval: int = 200,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 24):
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval, self.min_scale, self.max_scale = growth_interval, min_scale, max_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale = min(self.max_scale, self.scale * 2)
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
