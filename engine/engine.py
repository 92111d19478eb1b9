"""The engine: forward, backward, step, in DeepSpeed's shape, delegating the mechanisms.

``engine(*args)`` runs the model's forward (waiting for post-step all-gathers, gathering the
stage-3 root unit); ``backward(loss)`` scales the loss by ``loss_scale / gradient_accumulation_steps``
and lets the partition reduce gradients (at every micro-batch at stages 2-3, at the boundary at
0-1, never inside ``no_sync()``); ``step()`` counts micro-batches and, at the accumulation
boundary, runs the sharded optimizer step, the loss scaler and the learning-rate schedule.
The engine itself allocates nothing large.
See note: module current (docs/design-notes.md).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from zeroplus.accelerator import Accelerator
from zeroplus.activations import SavedTensorRouter
from zeroplus.activations.choices import TechniqueChoice
from zeroplus.activations.forward_census import ForwardCensus, storage_keys_of
from zeroplus.collectives import Collectives
from zeroplus.config import ResolvedConfig
from zeroplus.eager import compiled_modules
from zeroplus.ledger import Ledger
from zeroplus.optim.forward_only import WHY as FORWARD_ONLY
from zeroplus.optim.forward_only import ForwardOnly
from zeroplus.parallel.moe import set_aux_grad_scale
from zeroplus.parallel.pipeline import PipelineModule
from zeroplus.parallel.pipeline_schedule import eval_batch, train_batch
from zeroplus.zero import ShardedStep, StepOutcome, ZeroPartition

from .accessors import EngineAccessors
from .checkpoint_methods import CheckpointMethods
from .checkpoints.async_save import AsyncSaves
from .compile import CompiledUnits, compile_settings
from .embedding_tables import EmbeddingTables
from .exit_grace import register_exit_grace
from .lifecycle import collected, wait_at_exit
from .loss_scaler import LossScaler
from .micro_step import Life, MicroStep
from .model_changes import ModelChanges
from .skipped_steps import SkippedSteps
from .state_offload import StateOffload
from .watch import Watch

logger = logging.getLogger("zeroplus.engine")


@dataclass(frozen=True)
class TrainingParts:
    """What ``build_engine`` assembles for an ``Engine`` to drive: the partition (flat buffers, masters,
    shards), the step over it, the optimizer over the master shards, its schedule, the loss scaler, and
    the saved-tensor router of the activation techniques (an empty router when none is on)."""

    partition: ZeroPartition
    step: ShardedStep
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    loss_scaler: LossScaler
    activations: SavedTensorRouter
    choices: dict[str, TechniqueChoice]  # which techniques run, and why (zeroplus/activations/choices.py)



class Engine(CheckpointMethods, EngineAccessors):
    def __init__(self, module: torch.nn.Module, config: ResolvedConfig, parts: TrainingParts, dp: Collectives,
                 ledger: Ledger, accelerator: Accelerator, baseline_bytes: int, parallel: Any = None,
                 observed: bool = True) -> None:
        """``parts``: what ``build_engine`` assembled. ``baseline_bytes``: the device's memory at
        ``initialize`` without the model's own bytes (the peak above it is what ``zeroplus.estimate`` predicts).
        ``parallel``: the ParallelGroups when the model is split beyond data parallelism, else None.
        ``observed``: the timers, the communication log, the FLOPs profiler and the monitors the config asks
        for (False: the estimator's simulated engine, which has none)."""
        self._module = module
        self.config = config
        self.optimizer = parts.optimizer
        self._state_offload = StateOffload(self)
        self.lr_scheduler = parts.lr_scheduler
        self.loss_scaler = parts.loss_scaler
        self.dp = dp
        self.ledger = ledger
        self.accelerator = accelerator
        self._partition = parts.partition
        self._tables = EmbeddingTables(module, ledger)
        self._step = parts.step
        self._baseline = baseline_bytes
        # called once, before the first forward that trains (``zeroplus.initialize`` predicts the budget there)
        self._first_forward_hooks: list[Callable[[Engine, tuple[Any, ...], dict[str, Any]], None]] = []
        # collectives still in flight when the script ends without destroy() (the post-step all-gathers,
        # stage 3's prefetch) are waited for before the interpreter tears the process group down under them;
        # then, once per process and also when this engine is gone, gloo's workers get the GIL once more
        register_exit_grace()
        atexit.register(wait_at_exit, weakref.ref(self))
        # garbage-collected without destroy(): its hooks come off the model all the same (see note: lifecycle)
        self._compiled_units: list[CompiledUnits] = []
        self._observers: list[Any] = []  # this engine's observers of the collectives (its step timers)
        self._changes = ModelChanges(module)  # parameters or modules attached later: refused (model_changes.py)
        self._finalizer = weakref.finalize(self, collected, parts.partition, parts.activations, self._compiled_units,
                                           self._observers, self._changes)
        self._finalizer.atexit = False
        self.budget: Any = None  # the predicted ``zeroplus.MemoryBudget``, once ``record_budget`` has set it
        self.parallel = parallel
        self._checkpoint_saved = False  # the report compares with the predicted peak that includes a save
        self._saves = AsyncSaves()  # an asynchronous save in flight (checkpoints/async_save.py)
        self._activations = parts.activations
        self.choices = parts.choices  # the engine's decisions; self.config stays as resolved (frozen)
        self._activation_bytes: int | None = None  # what the first training forward left alive (_census)
        self._no_sync = False
        self._life = Life.LIVE  # micro_step.py
        # One backward() per micro-step, then step(); backwards inside no_sync() accumulate freely.
        self._micro = MicroStep.IDLE  # what the backwards since the last step() did (micro_step.py)
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary()
        self._last_step = StepOutcome(False)  # was_step_applied(); a device flag until read (see note: no host sync)
        self._compiled: CompiledUnits | None = None  # compile()
        self._forward_module = module  # what a forward calls: the model, or its torch.compile wrapper
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        dtype = parts.partition.groups[0].compute_dtype if parts.partition.groups else torch.float32
        self._skips = SkippedSteps(parts.loss_scaler.dynamic, dp.rank, str(dtype).replace("torch.", ""))
        # wall_clock_breakdown, comms_logger, flops_profiler and the monitors, those the config enables (watch.py)
        self._watch = Watch(config, accelerator, ledger, module, parts.partition,
                            parallel.global_rank if parallel is not None else dp.rank, observed)
        self._observers.extend(self._watch.observers)

    def train(self, mode: bool = True) -> Engine:
        self._module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    # -- forward / backward / step ------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_if_destroyed("forward")
        self._state_offload.refuse_if_offloaded("forward")
        self._changes.refuse_if_changed(self.dp.rank)
        if self._first_forward_hooks and torch.is_grad_enabled() and self._module.training:
            hooks, self._first_forward_hooks = self._first_forward_hooks, []
            for hook in hooks:
                hook(self, args, kwargs)
        timed = self._watch.forward(args, kwargs, self.global_steps + 1)
        census = self._census()
        self._partition.before_forward()
        try:
            activations = self._activations.forward(self._runs_compiled)
            with timed, activations, census if census is not None else contextlib.nullcontext():
                out = self._forward_module(*args, **kwargs)
            if census is not None:  # what is saved for backward: not the ledger's, not the output's own
                output = storage_keys_of(out) - self._activations.kept()  # (logits a lean loss keeps: saved)
                self._activation_bytes = census.alive_bytes(self.ledger.storage_keys() | output)
            return out
        finally:
            self._partition.after_forward()

    forward = __call__

    def _census(self) -> ForwardCensus | None:
        """The first training forward's census of what it leaves alive (``activations/forward_census.py``);
        None for every other forward, and for compiled modules."""
        if self._activation_bytes is not None or not (torch.is_grad_enabled() and self._module.training):
            return None
        if self._runs_compiled():
            self._activation_bytes = 0
            return None
        return ForwardCensus()

    def _runs_compiled(self) -> bool:
        """Whether the forward runs compiled code: ``compile()``, a ``torch.compile`` wrapper, or a module
        compiled in place (``module.compile()``, found by walking the modules)."""
        return self.is_compiled or bool(compiled_modules(self._module))

    def compile(self, backend: Any = "inductor", compile_kwargs: dict[str, Any] | None = None, schedule: Any = None,
                compiled_autograd_enabled: bool = False) -> None:
        """Compile each unit's forward with ``torch.compile(backend=backend, **compile_kwargs)``; the engine's
        gathers, releases, reductions and prefetches stay eager around the graphs (``engine/compile.py``).
        A second call with the same arguments does nothing; with others it is an error."""
        settings = compile_settings(backend, compile_kwargs, schedule, compiled_autograd_enabled)
        if self._compiled is not None:
            if settings != self._compiled.settings:
                raise ValueError(f"compile(): the engine is compiled already with {self._compiled.settings}; "
                                 f"asked again with {settings} (rank {self.dp.rank})")
            return
        units = [(u.name, u.module) for u in self._partition.units if not u.is_root]
        self._compiled = CompiledUnits(units or [("<model>", self._module)], settings)
        self._compiled_units.append(self._compiled)
        if self.dp.rank == 0:
            logger.info("compiled %d module(s) with backend %s: %s", len(self._compiled.names), backend,
                        ", ".join(self._compiled.names[:4]) + (" ..." if len(self._compiled.names) > 4 else ""))

    def forward_through(self, wrapper: torch.nn.Module) -> None:
        """Run every forward through ``wrapper`` (``torch.compile(model)``'s module, which ``initialize``
        was given): the engine partitions and names the model inside it, the forward stays compiled."""
        if getattr(wrapper, "_orig_mod", None) is not self._module:
            raise ValueError(f"forward_through(): {type(wrapper).__name__} does not wrap this engine's model")
        self._forward_module = wrapper

    @property
    def is_compiled(self) -> bool:
        """Whether ``compile()`` ran, or ``initialize`` was given a ``torch.compile`` wrapper."""
        return self._compiled is not None or self._forward_module is not self._module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (stages 0 and 1 only, as in DeepSpeed)."""
        if self._partition.stage.shards_gradients:
            raise ValueError(f"no_sync() is not possible at ZeRO stage {self._partition.stage}: gradients are "
                             f"partitioned during backward (rank {self.dp.rank})")
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _loss_factor(self, scale_wrt_gas: bool = True) -> float:
        """What the loss is multiplied by before its backward (loss scale / accumulation steps, or the
        loss scale alone when the caller averaged over micro-batches itself); MoE balancing losses
        (``zeroplus.parallel.moe``) get their gradient scaled alike."""
        factor = self.loss_scaler.scale / (self.gradient_accumulation_steps() if scale_wrt_gas else 1)
        set_aux_grad_scale(factor)
        return factor

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of one micro-batch's loss, divided by ``gradient_accumulation_steps`` unless
        ``scale_wrt_gas`` is False (as in DeepSpeed)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"backward() needs a scalar loss tensor, got {type(loss).__name__} "
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''} (rank {self.dp.rank})")
        self._refuse_unless_trainable("backward()")
        # Counting micro-steps, a second backward before step() is a forgotten step(). With the boundary
        # set from outside (Accelerate: backward, backward, ..., step at the boundary) backwards may
        # follow each other until one at the boundary has reduced the accumulated gradients.
        twice = (self._micro >= MicroStep.SYNCED and not self._no_sync if self._boundary_override is None
                 else self._micro == MicroStep.REDUCED)
        if twice:
            raise RuntimeError(f"backward() called twice without step() between them (rank {self.dp.rank}, micro-step "
                               f"{self.micro_steps}): each backward reduces this micro-batch's gradients, so a second "
                               f"one would reduce them again. Sum the losses and call backward() once, or call "
                               f"step() after each backward(); the engine is unchanged by this call")
        factor = self._loss_factor(scale_wrt_gas)
        reduce = self.is_gradient_accumulation_boundary() and not self._no_sync
        self._partition.begin_backward(reduce)
        self._micro = self._micro.raised(MicroStep.REDUCED if reduce else
                                         MicroStep.BACKWARD if self._no_sync else MicroStep.SYNCED)
        with self._watch.backward(loss):
            (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
            self._partition.end_backward()
        if not retain_graph:
            self._activations.end_backward()
        return loss

    def backward_stage(self, output: torch.Tensor, grad: torch.Tensor | None, reduce: bool) -> None:
        """Backward of one pipeline chunk for one micro-batch: from the loss on the last chunk (``grad``
        None; scaled as ``backward`` scales it), else from the gradient the next chunk sent. ``reduce``:
        this is the batch's last backward on this rank (gradients are reduced at its end)."""
        self._partition.begin_backward(reduce and not self._no_sync)
        self._micro = self._micro.raised(MicroStep.BACKWARD)
        factor = self._loss_factor()
        if grad is None:
            (output * factor if factor != 1.0 else output).backward()
        else:
            torch.autograd.backward(output, grad)
        self._partition.end_backward()
        self._activations.end_backward()

    def train_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """One batch of ``gradient_accumulation_steps`` micro-batches through a ``PipelineModule`` (1F1B,
        ``zeroplus/parallel/pipeline_schedule.py``), the optimizer step included; the batch's mean loss."""
        if not isinstance(self._module, PipelineModule):
            raise TypeError(f"train_batch() runs a PipelineModule; this engine wraps {type(self._module).__name__} "
                            f"(call engine(batch), engine.backward(loss), engine.step() instead)")
        return train_batch(self, self._module, data_iter)

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        """The mean loss of ``gradient_accumulation_steps`` micro-batches through a ``PipelineModule``,
        forward only (as DeepSpeed's pipeline engine has it); every stage returns it."""
        if not isinstance(self._module, PipelineModule):
            raise TypeError(f"eval_batch() runs a PipelineModule; this engine wraps {type(self._module).__name__} "
                            f"(call engine(batch) under torch.no_grad() instead)")
        return eval_batch(self, self._module, data_iter)

    def offload_states(self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> int:
        """Move the training states (``include``: DeepSpeed's ``OffloadStateTypeEnum`` kinds or their names;
        all by default) off the device into host memory, bit for bit (``engine/state_offload.py``); forward,
        backward and step are errors until ``reload_states()``. Returns the bytes moved on this rank."""
        if str(getattr(device, "value", device)) != "cpu":
            raise ValueError(f"offload_states(device={device!r}) on rank {self.dp.rank}: the states go to host "
                             f"memory ('cpu'); NVMe is offload_optimizer's and offload_param's tier")
        return self._state_offload.offload(include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> int:
        """Bring back what ``offload_states()`` moved; returns the bytes moved (0 if nothing was off)."""
        return self._state_offload.reload(non_blocking)

    def _refuse_unless_trainable(self, call: str) -> None:
        """``backward()`` and ``step()`` need a live engine, the states on the device and an optimizer."""
        self._refuse_if_destroyed(call)
        self._state_offload.refuse_if_offloaded(call)
        if isinstance(self.optimizer, ForwardOnly):
            raise RuntimeError(f"{call} on rank {self.dp.rank}: {FORWARD_ONLY}; give the config an 'optimizer' block "
                               f"(or optimizer=) to train the model")

    def step(self) -> None:
        """Ends a micro-step; at the accumulation boundary, the optimizer step. An error (nothing
        changes) when no backward() ran since the last step(): stepping on no gradient would move the
        weights by the optimizer's momentum alone."""
        self._refuse_unless_trainable("step()")
        if self._micro == MicroStep.IDLE:
            raise RuntimeError(f"step() called without a backward() since the last step() (rank {self.dp.rank}, "
                               f"micro-step {self.micro_steps}, global step {self.global_steps}): there is no "
                               f"gradient to step on; the engine is unchanged")
        self._saves.poll(self.dp)  # an asynchronous save: finished, or failed on every rank, at this step
        self._micro = MicroStep.IDLE
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        with self._watch.step():
            self._saves.wait_staged()  # an asynchronous save has its copy of what this step changes
            outcome = self._step.step(self.loss_scaler.scale)
            self._tables.step(outcome)  # sharded embedding tables: their row updates (embedding_tables.py)
            self._last_step = outcome
            flag = outcome.found_inf
            if flag is not None and not self._tables.collections:  # an overflow skipped in the kernel: read later
                self._skips.flagged(flag, self.global_steps + 1)
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            elif outcome.applied():
                self.loss_scaler.update(overflow=False)
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self.loss_scaler.update(overflow=True)
                self._skips.skipped(self.global_steps, self._step.last_grad_norm, self.loss_scaler.scale)
            self._partition.after_step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._watch.step_end(self)
        if self.global_steps % self.config.steps_per_print == 0:
            _ = self.skipped_steps  # the overflow flags since the last report read: a skipped step is warned about
            self._watch.report(self)
            if self.dp.rank == 0:
                logger.info("step %d: lr %s, grad norm %.4g, loss scale %g; %s", self.global_steps, self.get_lr(),
                            self._step.last_grad_norm or 0.0, self.loss_scaler.scale,
                            self.memory_report().peak_line())
            if self.config.memory_breakdown:
                logger.info("step %d\n%s", self.global_steps, self.memory_report())

    # -- memory ------------------------------------------------------------------------------------
    def before_first_forward(self, hook: Callable[[Engine, tuple[Any, ...], dict[str, Any]], None]) -> None:
        """Call ``hook(engine, args, kwargs)`` once, before the first forward run with gradients in training
        mode (the top layer predicts the memory budget from those inputs this way)."""
        self._first_forward_hooks.append(hook)

    def record_budget(self, budget: Any) -> None:
        """The memory budget predicted for this run (``zeroplus.initialize``'s first-forward hook); the report
        compares the measured peak with it."""
        self.budget = budget

    def destroy(self) -> None:
        """End the engine and give the model back: in-flight collectives waited for; at stage 3 the parameters
        gathered and left in the model with their current values (a collective: every rank calls it, before
        destroying the process group; one model's worth of memory, as before ``initialize``); every hook the
        engine put on the model removed (ZeRO's, the memory techniques', compiled units'), so ``initialize`` may
        take the same model again. Later forward, backward and step calls raise. A second call does nothing."""
        if self._life is Life.DESTROYED:
            return
        try:
            self._saves.wait()  # an asynchronous save committed first; its failure raised after the rest
        finally:
            self._finalizer.detach()
            self._watch.close()
            self._changes.remove()
            self._partition.remove()
            self._activations.remove()
            if self._compiled is not None:
                self._compiled.remove()
                self._compiled = None
            self._life = Life.DESTROYED

    def _refuse_if_destroyed(self, call: str) -> None:
        if self._life is Life.DESTROYED:
            raise RuntimeError(f"{call} on rank {self.dp.rank}: this engine was destroyed (engine.destroy()); the "
                               f"model holds its parameters again: zeroplus.initialize it anew to train on")
