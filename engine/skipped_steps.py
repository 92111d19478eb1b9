"""The engine's count of skipped optimizer steps, read from the device only when asked.

A step whose scalars stay on the device (see note: no host sync) leaves its overflow flag there: the flags are summed
on the device (one 0-d add a step) and read when the count is asked for (each ``steps_per_print`` report, a checkpoint
save, the caller), which is also when a skipped step is warned about. A step read on the host (dynamic fp16, other
optimizers) is counted and warned about at once. Memory: one 0-d tensor.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("zeroplus.engine")


class SkippedSteps:
    def __init__(self, dynamic_scale: bool, rank: int, dtype: str) -> None:
        """``dynamic_scale``: fp16's dynamic loss scale, whose overflows are expected (an info line, not a warning);
        ``rank`` and ``dtype`` (the compute dtype's name) for the warning."""
        self.dynamic_scale, self.rank, self.dtype = dynamic_scale, rank, dtype
        self._read = 0  # skipped steps counted so far
        self._unread: torch.Tensor | None = None  # the device flags of the steps since, summed
        self._since = 0  # the first global step whose flag ``_unread`` holds

    def flagged(self, found_inf: torch.Tensor, step: int) -> None:
        """Global step ``step`` left its overflow flag on the device (1.0 where the kernel skipped it)."""
        if self._unread is None:
            self._unread, self._since = found_inf.clone(), step
        else:
            self._unread.add_(found_inf)

    def skipped(self, step: int, norm: float | None, loss_scale: float) -> None:
        """Global step ``step`` was skipped, known on the host."""
        self._read += 1
        self._log(f"step {step}", norm, loss_scale)

    def count(self, now: int, loss_scale: float) -> int:
        """The skipped steps up to global step ``now``, the device's flags read (and warned about) first."""
        if self._unread is not None:
            skipped, self._unread = int(self._unread.item()), None
            if skipped:
                self._read += skipped
                self._log(f"{skipped} step(s) between steps {self._since} and {now}", None, loss_scale)
        return self._read

    def set(self, value: int) -> None:
        """The count a checkpoint restores."""
        self._read, self._unread = value, None

    def _log(self, which: str, norm: float | None, loss_scale: float) -> None:
        if self.dynamic_scale:
            logger.info("%s skipped: fp16 gradient overflow; loss scale lowered to %g", which, loss_scale)
            return
        logger.warning("%s skipped on rank %d: the gradients were not finite%s in %s training, so the weights and "
                       "optimizer states were left as they were. There is no loss scale to lower here: a loss or "
                       "activation was inf/NaN (check the batch, the learning rate, the model's numerics); %d step(s) "
                       "skipped so far", which, self.rank, "" if norm is None else f" (global norm {norm})",
                       self.dtype, self._read)
