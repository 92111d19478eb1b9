"""``DeepSpeedZeroOptimizer``: the optimizer ``deepspeed.initialize`` returns, served by the engine.

DeepSpeed returns its ZeRO optimizer wrapper; callers read its ``param_groups`` (learning rates),
``overflow`` (Accelerate's ``step_was_skipped``), ``loss_scale``, ``state_dict()``, and wrap it in
their own optimizer classes whose ``step``/``zero_grad`` do nothing, since the engine's ``step()``
runs the update. This view holds nothing: each attribute reads the zeroplus engine's torch optimizer
over the master shards (``optimizer``) or its step counters.
"""
from __future__ import annotations

from typing import Any

import torch

from zeroplus.engine.engine import Engine

from .parameter_offload import ParameterOffload
from .unsupported import refuse


class DeepSpeedZeroOptimizer:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._offload: ParameterOffload | None = None

    @property
    def parameter_offload(self) -> ParameterOffload:
        """Stage 3: the hooks TRL pauses to generate from the gathered model (``parameter_offload.py``);
        an ``AttributeError`` (absent, as in DeepSpeed) at stages 0-2."""
        if self._offload is None:
            self._offload = ParameterOffload(self._engine)
        return self._offload

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's master shards."""
        return self._engine.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._engine.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self._engine.optimizer.defaults

    @property
    def state(self) -> Any:
        return self._engine.optimizer.state

    @property
    def overflow(self) -> bool:
        """The last boundary's step was skipped (fp16 overflow, or gradients not finite)."""
        return self._engine.global_steps > 0 and not self._engine.was_step_applied()

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    cur_scale = loss_scale

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer states (the engine's checkpoint holds all of them)."""
        return self._engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        refuse("the ZeRO optimizer's load_state_dict", "load the engine's checkpoint with engine.load_checkpoint()")

    def step(self, closure: Any = None) -> None:
        refuse("the ZeRO optimizer's step()", "call engine.step(), which runs the update at the accumulation boundary")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears its gradient buffers after each step."""

    def __repr__(self) -> str:
        return f"DeepSpeedZeroOptimizer(zeroplus, {self._engine.optimizer!r})"
