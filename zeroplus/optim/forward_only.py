"""The optimizer of an engine built without one: a forward-only engine (TRL's reference model).

``deepspeed.initialize(model=ref, config=cfg)`` with no optimizer anywhere is how TRL and
Accelerate prepare a model that is only evaluated. Such an engine trains nothing: no parameter is
in an optimizer group, so none gets a gradient buffer, a master or an optimizer state (memory: the
parameters in the compute dtype, placed as frozen parameters are, plus the activations of a forward
without gradients). ``ForwardOnly`` stands where the optimizer would, with no parameter groups'
parameters; stepping it is an error, and the engine refuses ``backward()`` and ``step()`` first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

WHY = ("this engine was initialized without an optimizer (no 'optimizer' block in the config and no optimizer=): "
       "it runs forward only, as a reference or evaluation model")


class ForwardOnly(torch.optim.Optimizer):
    """An optimizer over nothing, for an engine that only runs forward."""

    def __init__(self) -> None:
        super().__init__([{"params": []}], {})

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        raise RuntimeError(f"step(): {WHY}")
