"""The wall-clock breakdown (DeepSpeed's ``"wall_clock_breakdown": true``): where each optimizer step's time goes.

Timers, per optimizer step (summed over its micro-steps):

- ``fwd``: the engine's forward calls;
- ``bwd``: its backward calls, split into ``bwd_allreduce`` (the time those calls were blocked waiting for
  gradient reductions: reduce-scatters and all-reduces waited for inside backward) and ``bwd_inner`` (the
  rest: the backward computation and issuing the reductions);
- ``step``: the optimizer step at the accumulation boundary (unscaling and clipping, the optimizer, issuing
  the post-step gathers of stages 1-2);
- ``gather_wait``: the time blocked waiting for all-gathers anywhere (stage 3's parameters in forward and
  backward, stages 1-2's post-step gathers), already inside the timers above;
- ``offload_wait``: the time blocked waiting for the offload tiers' reads and writes (``Tier.get``,
  ``Tier.wait_written``), already inside the timers above.

Where there is a device, ``fwd``, ``bwd`` and ``step`` are timed with events recorded on the current stream
and read at the report (which synchronizes once); on CPU with ``time.perf_counter``. The waits are host time:
the caller was blocked. Collective waits come from the communication observers (``comm_observers.py``),
offload waits from the ledger's wait clock (every tier has the engine's ledger).

Every ``steps_per_print`` optimizer steps rank 0 logs, in DeepSpeed's shape, the mean per step over those
steps: ``time (ms) | fwd: 12.31 | bwd: 30.20 | bwd_inner: 25.10 | bwd_allreduce: 5.10 | step: 8.00 |
gather_wait: 1.20 | offload_wait: 0.00``. ``engine.timers`` is this object (``last``: that report, ms per
step). Off (the default) the engine holds None and pays one ``is None`` per call. Memory: two events per
timed call on a device until the report.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from zeroplus.comm_observers import Completed

NAMES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "gather_wait", "offload_wait")


class StepTimers:
    """The breakdown's clocks; an observer of the collectives (attached by the engine)."""

    def __init__(self, accelerator: Any, ledger: Any) -> None:
        self._accelerator = accelerator
        self._device = not accelerator.host_is_device
        self._ledger = ledger
        self._seconds = dict.fromkeys(NAMES, 0.0)
        self._events: list[tuple[str, Any, Any]] = []
        self._phase: str | None = None
        self._offload_mark = ledger.wait_seconds
        self.steps = 0
        self.last: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time ``name`` (``fwd``, ``bwd`` or ``step``) around the block."""
        outer, self._phase = self._phase, name
        if self._device:
            start = self._accelerator.new_event(enable_timing=True)
            start.record()
        else:
            begun = time.perf_counter()
        try:
            yield
        finally:
            self._phase = outer
            if self._device:
                end = self._accelerator.new_event(enable_timing=True)
                end.record()
                self._events.append((name, start, end))
            else:
                self._seconds[name] += time.perf_counter() - begun

    def completed(self, event: Completed) -> None:
        if event.kind == "all_gather":
            self._seconds["gather_wait"] += event.blocked
        elif event.kind in ("reduce_scatter", "all_reduce") and self._phase == "bwd":
            self._seconds["bwd_allreduce"] += event.blocked

    def step_done(self) -> None:
        self.steps += 1

    def report(self) -> dict[str, float]:
        """Milliseconds per optimizer step of each timer since the last report (then reset); kept as ``last``."""
        if self._events:
            self._accelerator.synchronize()
            for name, start, end in self._events:
                self._seconds[name] += start.elapsed_time(end) / 1e3
            self._events.clear()
        waited = self._ledger.wait_seconds
        self._seconds["offload_wait"] += waited - self._offload_mark
        self._offload_mark = waited
        self._seconds["bwd_inner"] = max(0.0, self._seconds["bwd"] - self._seconds["bwd_allreduce"])
        steps = max(self.steps, 1)
        self.last = {name: self._seconds[name] * 1e3 / steps for name in NAMES}
        self._seconds = dict.fromkeys(NAMES, 0.0)
        self.steps = 0
        return self.last

    @staticmethod
    def line(report: dict[str, float]) -> str:
        return "time (ms) | " + " | ".join(f"{name}: {report[name]:.2f}" for name in NAMES)
