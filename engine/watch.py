"""What the config asks to watch in a training run, in one place the engine calls at each phase.

The wall-clock breakdown (``step_timers.py``), the communication log (``zeroplus/comms_log.py``), the FLOPs
profiler (``flops_profiler.py``) and the monitors (``monitors.py``) each need the same moments: a forward
begins (its inputs), a backward begins (its loss) and ends, an optimizer step is taken, and every
``steps_per_print`` steps a report. ``Watch`` holds whichever the config enabled (None for the others) and
turns those moments into their calls, so the engine's forward, backward and step each make one call here.
Each also names the engine's phase for the fault dumps and turns an out-of-memory error into a dump of the
rank's memory (``zeroplus/fault_dumps.py``). With everything off each call is a few ``is None`` tests and a
context manager. The estimator's simulated engine watches nothing.

Memory: each part's (a few numbers; the step's loss summed on the device, read once per step when a monitor
is on).
See note: watch (docs/design-notes.md).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from zeroplus import comm_observers, fault_dumps
from zeroplus.comms_log import CommsLog, process_log
from zeroplus.ledger import Category

from .flops_profiler import FlopsProfiler, device_peak
from .monitors import Event, Monitors
from .step_timers import StepTimers

logger = logging.getLogger("zeroplus.engine")

BREAKDOWN_EVENTS = (("forward", "fwd"), ("backward", "bwd"), ("backward_inner", "bwd_inner"),
                    ("backward_allreduce", "bwd_allreduce"), ("step", "step"), ("gather_wait", "gather_wait"),
                    ("offload_wait", "offload_wait"))


def tokens_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The tokens of a forward's inputs: the elements of its largest integer tensor (token ids), else 0."""
    sizes = [v.numel() for v in (*args, *kwargs.values())
             if isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex()]
    return max(sizes, default=0)


class Watch:
    """The enabled watchers of one engine."""

    def __init__(self, config: Any, accelerator: Any, ledger: Any, module: torch.nn.Module, partition: Any,
                 rank: int, observed: bool) -> None:
        self.ledger, self._accelerator, self._rank = ledger, accelerator, rank
        self.timers = StepTimers(accelerator, ledger) if config.wall_clock_breakdown and observed else None
        if self.timers is not None:
            comm_observers.attach(self.timers)
        logged = config.comms_logger
        self.comms_log: CommsLog | None = process_log(logged.prof_all, logged.prof_ops, logged.verbose) \
            if logged.enabled and observed else None
        self.flops = _flops_profiler(config, accelerator, module, partition) \
            if config.flops_profiler.enabled and observed else None
        self.monitors = Monitors(config, rank) if Monitors.wanted(config) and observed else None
        self._loss: torch.Tensor | None = None  # the losses given to backward() this step (monitors)
        self._losses = 0
        self._tokens = 0  # tokens given to forward since the last report (monitors)
        self._report_at = (time.perf_counter(), 0)  # when, and at how many samples, the last report was

    @property
    def observers(self) -> list[Any]:
        """What this engine attached to the collectives (detached when it ends)."""
        return [self.timers] if self.timers is not None else []

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any], next_step: int) -> "_Phase":
        """Around a forward of optimizer step ``next_step``."""
        return _Phase(self, "forward", args, kwargs, next_step)

    def backward(self, loss: torch.Tensor) -> "_Phase":
        """Around a backward of ``loss``."""
        return _Phase(self, "backward", loss)

    def step(self) -> "_Phase":
        """Around the optimizer step."""
        return _Phase(self, "step")

    def _begin(self, phase: str, args: tuple[Any, ...]) -> None:
        """``phase`` begins (``_Phase.__enter__``): named for the fault dumps, told to the watchers on."""
        fault_dumps.set_phase(phase)
        if phase == "forward":
            if self.flops is not None:
                self.flops.micro_start(args[2])
            if self.monitors is not None:
                self._tokens += tokens_in(args[0], args[1])
        elif phase == "backward":
            if self.flops is not None:
                self.flops.before_backward()
            if self.monitors is not None:
                loss = args[0]
                self._loss = loss.detach().float() + (self._loss if self._loss is not None else 0.0)
                self._losses += 1

    def _failed(self, err: BaseException) -> None:
        """An error leaves the engine's forward, backward or step: an out-of-memory one leaves the rank's memory
        state in a file its note names (``zeroplus/fault_dumps.py``) on its way up."""
        if fault_dumps.is_out_of_memory(err):
            fault_dumps.out_of_memory(err, self._rank, self.ledger, self._accelerator)

    def step_end(self, engine: Any) -> None:
        """After the optimizer step and the counters: count it, and write its monitors' events."""
        if self.timers is not None:
            self.timers.step_done()
        if self.flops is not None:
            self.flops.step_end(engine.dp.rank)
        if self.monitors is not None:
            self.monitors.write(self._step_events(engine))

    def _step_events(self, engine: Any) -> list[Event]:
        samples = engine.global_samples
        events = [("Train/Samples/lr", float(engine.optimizer.param_groups[0]["lr"]), samples)]
        if self._loss is not None:
            events.append(("Train/Samples/train_loss", float(self._loss) / self._losses, samples))
        self._loss, self._losses = None, 0
        norm = engine.get_global_grad_norm()
        if norm is not None:
            events.append(("Train/Samples/grad_norm", float(norm), samples))
        if engine.config.fp16.enabled:
            events.append(("Train/Samples/loss_scale", float(engine.loss_scaler.scale), samples))
        return events

    def report(self, engine: Any) -> None:
        """Every ``steps_per_print`` steps: the breakdown's line on rank 0, the straggler's tally (one small
        all-gather over the data group), the FLOPs rate, and their monitors' events, for those that are on."""
        events: list[Event] = []
        samples, rank0 = engine.global_samples, engine.dp.rank == 0
        if self.timers is not None:
            report = self.timers.report()
            if rank0:
                logger.info("step %d: %s", engine.global_steps, StepTimers.line(report))
            events += [(f"Train/Samples/elapsed_time_ms_{name}", report[key], samples)
                       for name, key in BREAKDOWN_EVENTS]
        if self.comms_log is not None:
            self.comms_log.straggler(engine.dp)
        if self.flops is not None:
            rate = self.flops.report()
            if rate and rank0:
                logger.info("step %d: %s", engine.global_steps, self.flops.line(rate))
            if rate:
                events += [("Train/Samples/tflops", rate["tflops"], samples),
                           ("Train/Samples/mfu", rate["mfu"], samples)]
        if self.monitors is not None:
            self.monitors.write(events + self._rate_and_memory_events(engine))

    def _rate_and_memory_events(self, engine: Any) -> list[Event]:
        """Samples and tokens per second since the last report; the memory per category, measured and predicted."""
        now, samples = time.perf_counter(), engine.global_samples
        (since, before), self._report_at = self._report_at, (now, samples)
        seconds = max(now - since, 1e-9)
        events = [("Train/Samples/samples_per_second", (samples - before) / seconds, samples),
                  ("Train/Samples/tokens_per_second", self._tokens * engine.dp.size / seconds, samples)]
        self._tokens = 0
        events += [(f"Memory/measured_peak_bytes/{c.value}", float(self.ledger.peak_bytes(c)), samples)
                   for c in Category]
        if engine.budget is not None:
            events += [(f"Memory/predicted_peak_bytes/{name}", float(value), samples)
                       for name, value in engine.budget.category_peaks.items()]
        return events

    def close(self) -> None:
        """The engine ends: observers detached, monitors' files closed."""
        for observer in self.observers:
            comm_observers.detach(observer)
        if self.monitors is not None:
            self.monitors.close()


class _Phase:
    """The context ``Watch.forward``, ``backward`` and ``step`` return: the phase begun at entry, timed when the
    breakdown is on, an error on its way out handed to ``Watch._failed``, and a backward's end told to the FLOPs
    profiler. A class rather than generator context managers nested three deep: entered three times a step, about
    4 us a phase less (see note: watch)."""

    __slots__ = ("_watch", "_phase", "_args", "_timed")

    _TIMER_NAMES = {"forward": "fwd", "backward": "bwd", "step": "step"}

    def __init__(self, watch: Watch, phase: str, *args: Any) -> None:
        self._watch, self._phase, self._args = watch, phase, args
        self._timed: Any = None

    def __enter__(self) -> None:
        watch = self._watch
        watch._begin(self._phase, self._args)
        if watch.timers is not None:
            self._timed = watch.timers.timed(self._TIMER_NAMES[self._phase])
            self._timed.__enter__()

    def __exit__(self, kind: Any, err: BaseException | None, trace: Any) -> None:
        watch = self._watch
        try:
            if err is not None:
                watch._failed(err)
        finally:
            if self._timed is not None:
                self._timed.__exit__(kind, err, trace)
        if err is None and self._phase == "backward" and watch.flops is not None:
            watch.flops.after_backward()


def _flops_profiler(config: Any, accelerator: Any, module: torch.nn.Module, partition: Any) -> FlopsProfiler:
    groups = partition.groups
    trained = sum(g.numel for g in groups)
    flat = {id(p) for g in partition.groups + partition.frozen for p in g.params}
    total = trained + sum(g.numel for g in partition.frozen) + sum(
        p.numel() for p in module.parameters() if id(p) not in flat)
    dtype = groups[0].compute_dtype if groups else torch.float32
    return FlopsProfiler(config.flops_profiler, lambda: device_peak(accelerator, dtype, config.zeroplus.peak_tflops),
                         (total, trained), module)
