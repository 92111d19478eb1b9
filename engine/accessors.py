"""What an engine tells about itself: DeepSpeed's accessors and the inspection surface, read from its state.

DeepSpeed's engine answers ``train_batch_size()``, ``gradient_accumulation_steps()``, the accumulation boundary
(``is_gradient_accumulation_boundary``, set from outside by Accelerate), ``was_step_applied()``, the skipped steps,
the gradient norm, the learning rates and the loss scale; the Trainer, Accelerate and the DeepSpeed API read them.
Beside them, what tests and tools inspect (``partition``, ``activations``, ``sharded_step``), the step counters a
checkpoint saves (``counters``/``set_counters``), the observers' readings (``timers``, ``comms_log``, ``flops``) and
the memory report beside the predicted budget (``memory_report``), the model (``module``) and an asynchronous save
in flight (``async_saves``). The checkpoint mechanisms (``engine/checkpoints/``) read the engine through this class.
``Engine`` (``engine.py``) takes them as a base class: every method here reads or sets state the engine owns and
changes nothing else. Memory: none.
"""
from __future__ import annotations

from typing import Any

import torch

from zeroplus.accelerator import Accelerator
from zeroplus.activations import SavedTensorRouter
from zeroplus.collectives import Collectives
from zeroplus.comms_log import CommsLog
from zeroplus.config import ResolvedConfig, ZeroStage
from zeroplus.ledger import Ledger
from zeroplus.memory_report import MemoryReport
from zeroplus.parallel import ParallelGroups
from zeroplus.zero import ShardedStep, StepOutcome, ZeroPartition

from .checkpoints.async_save import AsyncSaves
from .flops_profiler import FlopsProfiler
from .loss_scaler import LossScaler
from .skipped_steps import SkippedSteps
from .step_timers import StepTimers
from .watch import Watch

_COUNTERS = ("global_steps", "micro_steps", "global_samples", "skipped_steps")  # counters()


class EngineAccessors:
    """The readings of ``Engine``'s state (the attributes below are the engine's, set in its ``__init__``)."""

    config: ResolvedConfig
    dp: Collectives
    optimizer: torch.optim.Optimizer
    loss_scaler: LossScaler
    micro_steps: int
    global_steps: int
    global_samples: int
    _partition: ZeroPartition
    _step: ShardedStep
    _activations: SavedTensorRouter
    _boundary_override: bool | None
    _last_step: StepOutcome
    _skips: SkippedSteps
    _watch: Watch
    accelerator: Accelerator
    ledger: Ledger
    budget: Any
    _baseline: int
    _checkpoint_saved: bool
    _activation_bytes: int | None
    _module: torch.nn.Module
    _saves: AsyncSaves
    lr_scheduler: Any
    parallel: ParallelGroups | None

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model, its parameters current. ``step()`` returns with the post-step all-gathers
        (stages 1-2) complete unless ``zeroplus.overlap_param_gather`` defers them to the next forward; then
        this property, the model's own ``state_dict()`` and its forward wait for them, while its parameter
        tensors read directly hold the values before the step until then. At stage 3 ``state_dict()``
        gathers: ``zeroplus/zero/stage3_state_dict.py``."""
        self._partition.wait_all()
        return self._module

    @property
    def async_saves(self) -> AsyncSaves:
        """The asynchronous save in flight, if any (``engine/checkpoints/async_save.py``)."""
        return self._saves

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> ZeroStage:
        return self._partition.stage

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether this micro-step ends the accumulation: every ``gradient_accumulation_steps``-th one,
        unless the caller said otherwise with ``set_gradient_accumulation_boundary``."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide the boundary from outside (Accelerate calls it before each backward; an epoch that ends
        mid-accumulation steps early); it holds until set again, ``None`` returns to counting."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary() takes a bool or None, got {is_boundary!r} "
                            f"(rank {self.dp.rank})")
        self._boundary_override = is_boundary

    def was_step_applied(self) -> bool:
        """Whether the last boundary's optimizer step changed the weights (False when it was skipped)."""
        return self._last_step.applied()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for gradients that were not finite. A step whose overflow flag stayed on the
        device is counted (and warned about) when this is read: at each ``steps_per_print`` report, a checkpoint
        save, or by the caller."""
        return self._skips.count(self.global_steps, self.loss_scaler.scale)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skips.set(value)

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (unscaled, before clipping) of the last step; inf on overflow."""
        return self._step.last_grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def partition(self) -> ZeroPartition:
        """The ZeRO partition, for tests and tools that inspect it: ``units``, ``groups`` (each flat group's
        ``names``, ``shapes``, ``master_store``, ``owned_start``/``owned_numel``), ``stage``, ``describe()``.
        Reading is safe; changing it is not supported."""
        return self._partition

    @property
    def activations(self) -> SavedTensorRouter:
        """The activation techniques' saved-tensor router, for tests and tools that inspect it: ``claimers``,
        ``around`` (the forward modes: each one's ``taken`` and ``idle``), ``waits_on_tail``. Reading is safe;
        changing it is not supported."""
        return self._activations

    @property
    def sharded_step(self) -> ShardedStep:
        """The optimizer step over this rank's shards (checkpoints read and write its states through it)."""
        return self._step

    def counters(self) -> dict[str, int]:
        """The step counters a checkpoint saves: global and micro steps, samples, skipped steps."""
        return {k: getattr(self, k) for k in _COUNTERS}

    def set_counters(self, values: dict[str, int]) -> None:
        """Set the step counters (a checkpoint load): exactly the keys ``counters()`` has, each an integer."""
        if set(values) != set(_COUNTERS) or not all(isinstance(v, int) for v in values.values()):
            raise ValueError(f"set_counters needs integers for exactly {list(_COUNTERS)} (rank {self.dp.rank}), "
                             f"got {values}")
        for k, v in values.items():
            setattr(self, k, v)
        for g in self._partition.groups:  # bf16 masters' stochastic rounding draws by the step count
            g.master_store.set_step_count(self.global_steps)

    def consolidated_fp32_state(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's full fp32 master value by name, on every rank (a collective at
        stages 1-3: every rank calls it). Memory: the whole model in fp32."""
        return self._partition.consolidated_fp32_state()

    def optimizer_state(self, group: Any) -> dict[str, Any]:
        """The optimizer state of one flat group's owned range (read back from its tier when offloaded)."""
        return self._step.state_of(group)

    @property
    def timers(self) -> StepTimers | None:
        """The wall-clock breakdown (``wall_clock_breakdown``; ``step_timers.py``), or None."""
        return self._watch.timers

    @property
    def comms_log(self) -> CommsLog | None:
        """The communication log (``comms_logger``; ``zeroplus/comms_log.py``), or None."""
        return self._watch.comms_log

    @property
    def flops(self) -> FlopsProfiler | None:
        """The FLOPs profiler (``flops_profiler``; ``flops_profiler.py``), or None."""
        return self._watch.flops

    def comms_summary(self) -> str:
        """The communication log's table (``comms_logger`` enabled), or a line saying it is off."""
        if self.comms_log is None:
            return "comms_logger is not enabled in this engine's config"
        return self.comms_log.summary()

    def memory_report(self) -> MemoryReport:
        """The ledger's live and peak bytes per category and the device's peak above the start of
        ``initialize`` (the model's own bytes included), beside the predicted budget if any."""
        peak = max(0, self.accelerator.max_memory_allocated() - self._baseline)
        return MemoryReport.from_ledger(self.dp.rank, self.ledger, peak, self.budget, self._checkpoint_saved,
                                        saved_for_backward=self._activation_bytes or 0,
                                        baseline_bytes=max(0, self._baseline))
