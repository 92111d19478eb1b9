"""Loss scaling for fp16, with DeepSpeed's defaults and skip-on-overflow semantics.

Static (``fp16.loss_scale > 0``): the scale never changes and an overflowing step is skipped.
Dynamic (``loss_scale: 0``): start at ``2**initial_scale_power``; an overflow (a non-finite
global gradient norm, which the all-reduce makes identical on every rank, so all ranks skip
together) skips the step and, once ``hysteresis`` overflows have been absorbed, halves the
scale (never below ``min_loss_scale``); ``loss_scale_window`` overflow-free steps double it.
bf16 and fp32 use scale 1 and never skip. No memory of its own.
"""
from __future__ import annotations

from typing import Any

from zeroplus.config import FP16Config


class LossScaler:
    def __init__(self, fp16: FP16Config | None) -> None:
        enabled = fp16 is not None and fp16.enabled is True
        self.dynamic = fp16 is not None and enabled and fp16.loss_scale == 0
        self.enabled = enabled
        if not enabled:
            self.scale = 1.0
            return
        assert fp16 is not None
        self.scale = float(2 ** fp16.initial_scale_power) if self.dynamic else float(fp16.loss_scale)
        self.window = fp16.loss_scale_window
        self.hysteresis = fp16.hysteresis
        self.consecutive_hysteresis = fp16.consecutive_hysteresis
        self.min_scale = fp16.min_loss_scale
        self.hysteresis_left = fp16.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step; ``overflow`` means it was skipped."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
