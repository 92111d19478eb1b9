"""``optimizer.parameter_offload``: the part of DeepSpeed's ZeRO-3 internals TRL reaches to generate.

TRL's ``unwrap_model_for_generation`` (GRPO, online DPO, GKD) gathers the whole model with
``GatheredParameters`` and then, so that generating token by token does not gather and release every
block per token, removes DeepSpeed's ZeRO-3 module hooks through ``optimizer.parameter_offload``:
it clears each parameter's ``ds_active_sub_modules``, calls ``remove()`` on each of
``forward_hooks``/``backward_hooks``, and afterwards re-registers them with
``_register_deepspeed_module(module)`` (invalidating ``param_coordinator``'s trace first when it is
valid). Here "removing" pauses the engine's stage-3 hooks (``Stage3Scheduler.paused``: a module's
forward neither gathers nor releases, so the gathered values are read as they are) and registering
resumes them. Nothing is held: the view reads the engine's scheduler. A forward while paused outside
a gather reads released (empty) parameters and fails loudly in torch, never silently.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from zeroplus.engine.engine import Engine


class _PauseHandle:
    """What TRL calls ``remove()`` on: pauses the engine's stage-3 forward hooks."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler

    def remove(self) -> None:
        self._scheduler.pause(True)


class _ModuleView:
    """The model as TRL iterates it there: its parameters, and DeepSpeed's external ones (none here)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def ds_external_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return []


class _Coordinator:
    """DeepSpeed's prefetch trace: zeroplus records its forward order afresh each forward."""

    def is_invalid_trace(self) -> bool:
        return True

    def _invalidate_trace(self) -> None:
        return None


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` as TRL uses it, over a zeroplus engine at stage 3."""

    def __init__(self, engine: Engine) -> None:
        scheduler = engine.partition.stage3
        if scheduler is None:
            raise AttributeError("parameter_offload exists at ZeRO stage 3 only")
        self._scheduler = scheduler
        self.module = _ModuleView(engine._module)
        self.param_coordinator = _Coordinator()
        self.forward_hooks: list[_PauseHandle] = [_PauseHandle(scheduler)]
        self.backward_hooks: list[_PauseHandle] = []
        for p in engine._module.parameters():
            if not hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules = set()  # type: ignore[attr-defined]

    def _register_deepspeed_module(self, module: Any) -> None:
        """Resume the engine's stage-3 hooks (what re-registering DeepSpeed's hooks does)."""
        self._scheduler.pause(False)
        self.forward_hooks = [_PauseHandle(self._scheduler)]
