"""``DeepSpeedEngine``: DeepSpeed's engine class, served by a zeroplus ``Engine``.

What callers written for DeepSpeed use: an ``nn.Module`` whose forward is the model's and whose
``module`` is the model (Accelerate and the Trainer unwrap it that way, and iterate its parameters),
``backward(loss, retain_graph, scale_wrt_gas)``, ``step()``, the accumulation boundary set from
outside, DeepSpeed's checkpoint calls with their keyword arguments and return values, the
consolidated 16-bit state dict at ZeRO-3, ``config`` as the raw dict, and DeepSpeed's small
accessors. Everything is delegated to the zeroplus ``Engine`` (``engine``): no second copy of any
tensor, no state of its own besides the raw config. A public DeepSpeed attribute that is not here
raises ``NotSupportedError`` naming it (``unsupported.py``).

Memory: ``_zero3_consolidated_16bit_state_dict`` gathers one module's parameters at a time
(``zeroplus.GatheredParameters``) and keeps rank 0's host copies: the whole model in the compute
dtype on rank 0's host, one module's parameters gathered on every rank.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
from typing import Any, Iterator

import torch

from zeroplus.engine.checkpoints.files import LATEST
from zeroplus.engine.engine import Engine
from zeroplus.logs import log_rank0
from zeroplus.zero.gathered import GatheredParameters

from .optimizer import DeepSpeedZeroOptimizer
from .unsupported import not_supported, refuse


class DeepSpeedEngine(torch.nn.Module):
    """DeepSpeed's engine over a zeroplus ``Engine`` (``engine``); ``config``: the raw config dict."""

    def __init__(self, engine: Engine, config: dict[str, Any]) -> None:
        super().__init__()
        self.engine = engine
        self.config = config
        self.optimizer = DeepSpeedZeroOptimizer(engine)
        self._modules["module"] = engine._module  # iterated by parameters(), state_dict(), train()

    # -- what nn.Module lookups do not find -------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
        raise not_supported(f"DeepSpeedEngine.{name}")

    @property
    def module(self) -> torch.nn.Module:  # type: ignore[override]
        """The model, its parameters current (post-step all-gathers waited for)."""
        return self.engine.module

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    @property
    def basic_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's master shards."""
        return self.engine.optimizer

    # -- forward / backward / step ----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None,  # type: ignore[override]
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's ``engine.compile()`` (Accelerate and the Trainer call it under ``--torch_compile``):
        the zeroplus engine compiles each unit's forward (``zeroplus/engine/compile.py``)."""
        self.engine.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)

    @property
    def is_compiled(self) -> bool:
        return self.engine.is_compiled

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True,
                 **unsupported: Any) -> torch.Tensor:
        if unsupported:
            refuse(f"DeepSpeedEngine.backward({', '.join(sorted(unsupported))}=...)")
        return self.engine.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """The engine's step; after the first optimizer step rank 0 logs the measured memory peak beside
        the predicted one once (callers that set ``steps_per_print`` to infinity see it too)."""
        if lr_kwargs:
            refuse("DeepSpeedEngine.step(lr_kwargs=...)", "the schedule steps without arguments")
        before = self.engine.global_steps
        self.engine.step()
        if before == 0 and self.engine.global_steps == 1:
            report = self.engine.memory_report()
            log_rank0("zeroplus after the first step: %s (engine.memory_report() has each category)",
                      report.peak_line())

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's signature (``include``: ``OffloadStateTypeEnum`` members; ``device``:
        ``OffloadDeviceEnum.cpu``): the engine's states to host memory until ``reload_states()``."""
        self.engine.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.engine.reload_states(non_blocking)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        return self.engine.was_step_applied()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.engine.no_sync():
            yield

    # -- accessors --------------------------------------------------------------------------------
    def zero_optimization(self) -> bool:
        return self.engine.zero_optimization_stage() > 0

    def zero_optimization_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def zero_optimization_partition_gradients(self) -> bool:
        return self.engine.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.engine.zero_optimization_stage() == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def zero_cpu_offload(self) -> bool:
        return self.engine.config.zero_optimization.offloads_optimizer

    def zero_offload_param(self) -> Any:
        return self.engine.config.zero_optimization.offload_param

    def zero_offload_optimizer(self) -> Any:
        return self.engine.config.zero_optimization.offload_optimizer

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled is True

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled is True

    def train_batch_size(self) -> int:
        return self.engine.train_batch_size()

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.train_micro_batch_size_per_gpu()

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps()

    def gradient_clipping(self) -> float:
        return float(self.engine.config.gradient_clipping or 0.0)

    def steps_per_print(self) -> int:
        return self.engine.config.steps_per_print

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.get_global_grad_norm()

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_samples

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale

    @property
    def global_rank(self) -> int:
        par = self.engine.parallel
        return par.global_rank if par is not None else self.engine.dp.rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self) -> int:
        par = self.engine.parallel
        return par.topology.world_size if par is not None else self.engine.dp.size

    @property
    def dp_world_size(self) -> int:
        return self.engine.dp.size

    @property
    def device(self) -> torch.device:
        return self.engine.accelerator.device()

    def get_data_parallel_rank(self) -> int:
        return self.engine.dp.rank

    def memory_report(self) -> Any:
        """zeroplus's ledger report (not DeepSpeed's): bytes per category, predicted beside measured."""
        return self.engine.memory_report()

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's signature; the checkpoint is zeroplus's (``global_stepN`` directories, ``latest``).
        ``exclude_frozen_parameters`` (the Trainer passes it for a PEFT model): the trained parameters,
        their optimizer states and the buffers only. True, as DeepSpeed returns."""
        self.engine.save_checkpoint(save_dir, None if tag is None else str(tag), client_state or None,
                                    save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None
                        ) -> tuple[str | None, dict[str, Any] | None]:
        """``(path, client_state)``; ``(None, None)`` with a warning when ``load_dir`` has no ``latest`` and no
        tag was given, as DeepSpeed does. Trained parameters are matched by name (a checkpoint that lacks
        one is an error naming it); ``load_module_strict=False`` (the Trainer's for a PEFT model) keeps
        the frozen parameters a checkpoint saved with ``exclude_frozen_parameters=True`` lacks."""
        if custom_load_fn is not None:
            refuse("DeepSpeedEngine.load_checkpoint(custom_load_fn=...)")
        if tag is None and not os.path.isfile(os.path.join(load_dir, LATEST)):
            log_rank0("no checkpoint to load: %s has no '%s' file and no tag was given", load_dir, LATEST,
                      level=logging.WARNING)
            return None, None
        path, client_state = self.engine.load_checkpoint(
            load_dir, None if tag is None else str(tag), load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            strict=load_module_strict)
        return path, client_state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        self.engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
        return True

    save_fp16_model = save_16bit_model

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict in the compute dtype on rank 0's host (``None`` on other ranks),
        gathered one module at a time; tied parameters stay one tensor under each name. Every rank calls it."""
        rank0 = self.engine.dp.rank == 0
        state: dict[str, torch.Tensor] | None = collections.OrderedDict() if rank0 else None
        copies: dict[int, torch.Tensor] = {}
        for prefix, module in self.engine.module.named_modules():
            params = [(n, p) for n, p in module.named_parameters(recurse=False)
                      if p.requires_grad or not exclude_frozen_parameters]
            with GatheredParameters([p for _, p in params], modifier_rank=None):
                if state is not None:
                    for name, p in params:
                        if id(p) not in copies:
                            copies[id(p)] = p.detach().to("cpu", copy=True)
                        state[f"{prefix}.{name}" if prefix else name] = copies[id(p)]
            if state is not None:
                for name, buf in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        state[f"{prefix}.{name}" if prefix else name] = buf.detach().to("cpu", copy=True)
        return state

    _consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict

    def destroy(self) -> None:
        self.engine.destroy()
