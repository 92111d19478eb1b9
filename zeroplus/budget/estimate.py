"""``zeroplus.estimate``: each rank's memory, per category and phase, before anything is launched.

    budget = zeroplus.estimate(model, "ds_config.json", world_size=64, micro_batch_size=4, seq_len=2048)
    print(budget)              # a table: phases x categories, the peak and where it occurs
    budget.peak_bytes, budget.peak_phase, budget.to_dict()

The prediction is the engine's own run on the meta device (``simulate.py``): model states from
the partition code, activations from the model's real forward under the config's recompute,
swap and checkpointing choices, gradients, buckets and windows from the reducer, scheduler and
tiers as they will run. It adds ``runtime``, what the process holds beyond tensors while
training (``runtime_overhead.py``: measured once per machine), from the moment the process takes it on.

Phases: ``init`` (``initialize``: the model as built, then cast and partitioned; with a model
built in fp32 that is 4 bytes per parameter on one rank, which ZeRO has not yet divided),
``forward``, ``backward`` and ``step``; the peak of each is taken over two optimizer steps, so
the optimizer states created by the first are there in the second. Then ``save``: a checkpoint
save after them (``engine/checkpoints/save.py``'s own ``rank_state``), which streams its file from the
training state and adds only the copies it must make (stage 0's slice of the full buffers, a
split master merged to fp32, states read back from a file tier). ``peak_bytes`` includes the
save; ``training_peak_bytes`` is the peak between saves.

Memory counted as the device would: on a CPU-only machine, resident memory above the process
before the model exists; on CUDA and NPU the caching allocator's peak (the runtime's context
is outside it, so ``runtime`` is 0 there).

Tensor, pipeline and expert parallelism (``zeroplus.parallel`` in the config): ``world_size`` is every
rank; the rank's model is built as that rank builds it (its tensor slice, pipeline stage and experts,
``virtual_parallel.py``), partitioned over its data group (experts over their expert-data group), and a
pipeline stage runs the real schedule, so it holds as many micro-batches' activations as 1F1B keeps.
See note: meta estimate (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch

from .. import flight_recorder
from ..accelerator import get_accelerator, techniques_by_default
from ..activations.resize_recompute import TECHNIQUE as RECOMPUTE
from ..config import ResolvedConfig, ZeroplusConfig, load_config, parse_bytes
from ..engine.build import compute_dtype
from ..host_allocator import caveat as host_allocator_caveat
from ..host_gemm_pool import pool_bytes
from ..host_kernel_cache import caveat as kernel_cache_caveat
from ..memory_view import CATEGORIES, LABELS, budget_chart
from ..parallel.groups import current_groups, parallel_groups
from .model_states import model_state_bytes
from .runtime_overhead import block_scaled_states_bytes, kernel_cache_bytes, runtime_bytes, second_simulation_bytes
from .simulate import _meta, _quiet, default_loss, group_stand_ins, meta_copy, simulate
from .tracker import PHASES, TRAINING_PHASES, cpu_workspace_bytes
from .virtual_parallel import topology_of


@dataclasses.dataclass
class MemoryBudget:
    """One rank's predicted memory: per phase, the peak and who holds it then."""

    rank: int
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    stage: int
    phases: dict[str, dict[str, int]]   # phase -> category -> bytes at that phase's peak
    model_states: dict[str, int]        # model_states.py: what stays between steps, device and tiers
    accelerator: str = "cpu"
    category_peaks: dict[str, int] = dataclasses.field(default_factory=dict)  # each ledger category's own peak
    saved_for_backward: int = 0  # what one forward leaves for backward outside the engine's buffers
    checkpoint_copies: int = 0   # what a checkpoint save copies to write its file (the rest streams)
    topology: str = ""           # with tensor, pipeline or expert parallelism: the split (Topology.describe)
    # what each activation technique takes off the training peak: the peak simulated with it off minus
    # the peak with it on (estimate(..., effects=True)); what it moves is in the run's MemoryReport.saved
    technique_effects: dict[str, int] = dataclasses.field(default_factory=dict)
    # the run is compiled (engine.compile(), compiled blocks or model): the activation and temporary figures
    # are eager's, and the compiler's own resident memory is not predicted (see note: compilation)
    compiled: bool = False
    # computes technique_effects on first need (resolve_effects: the engine's report), so a run that never
    # looks at its report does not pay the extra simulations
    pending_effects: Callable[[], dict[str, int]] | None = dataclasses.field(default=None, repr=False,
                                                                             compare=False)
    # what the prediction is known to leave out for this run (``caveats()``), each a sentence; logged as warnings
    caveats: list[str] = dataclasses.field(default_factory=list)
    # techniques on by default that this run turns off, with what each would have taken off the training peak
    # (too little: ``recompute_pays``); the engine's first forward reads it and the technique stands down
    stood_down: dict[str, int] = dataclasses.field(default_factory=dict)
    # techniques on by default that this run turns off because it fits without them (``techniques_by_default``
    # "where_needed"), each with why; the budget is the run without them (see note: techniques by default)
    not_needed: dict[str, str] = dataclasses.field(default_factory=dict)
    # what MKL's buffer pool adds from the first forward on (host_gemm_pool.py; in ``runtime``): CPU only
    host_buffers: int = 0

    def resolve_effects(self) -> dict[str, int]:
        """``technique_effects``, computing them now if they were left pending."""
        if self.pending_effects is not None:
            pending, self.pending_effects = self.pending_effects, None
            self.technique_effects = pending()
        return self.technique_effects

    @property
    def peak_phase(self) -> str:
        """The phase of the peak, a checkpoint save included."""
        return max(self.phases, key=lambda p: self.phases[p]["total"])

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase]["total"]

    @property
    def training_peak_phase(self) -> str:
        """The phase of the peak between checkpoint saves (what a run that has not saved yet reaches)."""
        return max(TRAINING_PHASES, key=lambda p: self.phases[p]["total"])

    @property
    def training_peak_bytes(self) -> int:
        return self.phases[self.training_peak_phase]["total"]

    @property
    def steps_peak_phase(self) -> str:
        """The phase of the steps' peak (forward, backward, optimizer step): the training peak less
        ``initialize``'s, which a model built whole on each rank may set and no activation technique changes."""
        return max((p for p in TRAINING_PHASES if p != "init"), key=lambda p: self.phases[p]["total"])

    @property
    def steps_peak_bytes(self) -> int:
        return self.phases[self.steps_peak_phase]["total"]

    def at_peak(self) -> dict[str, int]:
        """Bytes per category at the moment of the predicted peak."""
        return {c: self.phases[self.peak_phase].get(c, 0) for c in CATEGORIES}

    def to_dict(self) -> dict[str, Any]:
        self.resolve_effects()
        out = dataclasses.asdict(dataclasses.replace(self, pending_effects=None))
        del out["pending_effects"]
        out["peak_phase"], out["peak_bytes"] = self.peak_phase, self.peak_bytes
        out["training_peak_phase"], out["training_peak_bytes"] = self.training_peak_phase, self.training_peak_bytes
        return out

    def table(self) -> str:
        phases = list(self.phases)
        head = f"  {'category (MiB)':<34}" + "".join(f"{p:>10}" for p in phases)
        split = f"{self.topology}; " if self.topology else ""
        lines = [f"predicted memory of rank {self.rank} of {self.world_size} ({split}ZeRO stage {self.stage}, "
                 f"micro-batch {self.micro_batch_size} x accumulation {self.gradient_accumulation_steps}, "
                 f"{self.accelerator})", head]
        for c in CATEGORIES:
            if any(self.phases[p].get(c, 0) for p in phases):
                lines.append(f"  {LABELS[c]:<34}" + "".join(f"{self.phases[p].get(c, 0) / 2**20:10.1f}"
                                                             for p in phases))
        lines.append(f"  {'total at the phase peak':<34}" + "".join(f"{self.phases[p]['total'] / 2**20:10.1f}"
                                                                    for p in phases))
        lines.append(f"  peak: {self.peak_bytes / 2**30:.3f} GiB in {self.peak_phase}")
        if self.compiled:
            lines.append("  compiled: activations and temporaries are predicted as eager's (a compiled graph may save "
                         "other tensors); the compiler's own memory (about 50 MiB resident on CPU) is not included")
        lines += [f"  {technique} (on by default) is off: it would take at most {effect / 2**20:.1f} MiB off the "
                  f"steps' peak, under {100 * RECOMPUTE_PAYS_FROM:g}%" for technique, effect in self.stood_down.items()]
        lines += [f"  {technique} (on by default) is {why}" for technique, why in self.not_needed.items()]
        lines += [f"  not predicted: {caveat}" for caveat in self.caveats]
        tiers = {k: v for k, v in self.model_states.items() if k.endswith("_offloaded") and v}
        for key, value in tiers.items():
            lines.append(f"  on the offload tier, not in the device: {key} {value / 2**20:.1f} MiB")
        return "\n".join(lines)

    __str__ = table

    def save_chart(self, path: str) -> str:
        """A PNG of the predicted bytes per category, stacked per phase (``zeroplus[plotting]``)."""
        return budget_chart(self, path)


def _recompute_chosen(off: MemoryBudget, budget: MemoryBudget, resolved_cfg: ResolvedConfig, accelerator: str | None,
                      config: dict[str, Any] | str | ZeroplusConfig) -> MemoryBudget:
    """Of the runs without and with resize recompute left unset (both simulated at the first forward, so each carries
    the second simulation's residue from there on: the effects compare them), the one the engine runs: without it
    where it ran and takes under 1% off the steps' peak (``stood_down`` names what it takes off)."""
    kept = second_simulation_bytes(accelerator or get_accelerator().name, _compute_dtype_name(load_config(config)))
    peak = budget.steps_peak_bytes
    effect = off.steps_peak_bytes - peak
    recompute_ran = resolved_cfg.zeroplus.resize_recompute.enabled is True  # (left unset: resolved on)
    for run in (off, budget):
        for phase in PHASES[1:]:
            run.phases[phase]["runtime"] = run.phases[phase].get("runtime", 0) + kept
            run.phases[phase]["total"] += kept
    if recompute_ran and not recompute_pays(effect, peak):
        off.stood_down = {**off.stood_down, RECOMPUTE: effect}
        return off
    return budget


def estimate(model: torch.nn.Module | Callable[[], torch.nn.Module], config: dict[str, Any] | str | ZeroplusConfig, *,
             world_size: int, rank: int = 0, micro_batch_size: int | None = None, seq_len: int | None = None,
             example_inputs: tuple[Any, ...] | None = None, example_kwargs: dict[str, Any] | None = None,
             loss_fn: Callable[[Any], torch.Tensor] = default_loss, accelerator: str | None = None,
             effects: bool = False, construction: str = "whole", code: int | None = None,
             capacity: int | None = None) -> MemoryBudget:
    """Predict rank ``rank``'s memory for training ``model`` with ``config`` on ``world_size`` ranks.

    ``model``: a module (copied to the meta device; its own memory is untouched) or a function of
    no arguments that builds one (called on the meta device). Inputs: ``seq_len`` (token ids of
    ``micro_batch_size x seq_len``; the built-in GPT also gets them as targets and returns its
    loss) or ``example_inputs``/``example_kwargs`` (the forward's arguments for one micro-batch;
    only shapes and dtypes of tensors are used).
    ``loss_fn`` turns the model's output into the loss (default: the output if scalar, else the
    sum of its first tensor). ``accelerator``: whose runtime overhead to add (default: this
    machine's). ``effects``: also simulate the run once more with each activation technique that is on
    (``swap_attention``, ``resize_recompute``) turned off, and record what each takes off the training
    peak (``technique_effects``; one more simulation per technique, run when first needed:
    ``resolve_effects()``, ``to_dict()``, the engine's report). ``construction``: ``"whole"`` (the model
    built normally, whole on every rank at ``initialize``), ``"init"`` (built under ``zeroplus.Init``) or
    ``"meta"`` (built on the meta device): the init phase's peak differs (``simulate.py``).
    ``code``: how much of torch's code the process that will train already holds
    (``first_use.code_resident``, read by ``initialize``); None for a fresh process (``runtime_overhead.py``).
    Resize recompute left unset (on by default) is simulated without it first, and with it only where what that run
    holds for backward at its peak could make 1% of the steps' peak (``steps_peak_bytes``); where it takes under 1%
    off, the budget returned is the run without it (``stood_down`` names at most what it would take off), which is
    how the engine then runs (see note: recompute where it pays).
    Where ``zeroplus.techniques_by_default`` is (or the accelerator makes ``"auto"``) ``"where_needed"``, the
    techniques left unset (resize recompute, the lean loss, embedding rows) are first simulated off together; where
    that run's training peak is within ``NEEDED_FROM`` of ``capacity`` (default: ``zeroplus.memory_budget``, else this
    machine's device's, ``rank_capacity``), it is the budget (``not_needed`` says why), as the engine then runs (see
    note: techniques by default).
    """
    common: dict[str, Any] = dict(world_size=world_size, rank=rank, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                  loss_fn=loss_fn, accelerator=accelerator, code=code)
    examples = _meta(example_inputs) if example_inputs is not None else None  # shapes only: no batch kept
    kw_examples = _meta(example_kwargs) if example_kwargs is not None else None
    runs_without: dict[tuple[str, ...], MemoryBudget] = {}  # (the defaults' decisions and the effects share them)

    def without(*techniques: str) -> MemoryBudget:
        """The same run with ``techniques`` off (its own effects pending), simulated once; what it leaves unset runs as
        where they pay (whether the run needs them is decided here, once)."""
        if techniques not in runs_without:
            cfg = load_config(config)
            cfg.zeroplus.techniques_by_default = "where_they_pay"
            for technique in techniques:
                if technique in (LEAN, ROWS):
                    setattr(cfg.zeroplus, technique, False)
                    continue
                block = getattr(cfg.zeroplus, technique)
                block.enabled = False
                if hasattr(block, "by_default"):
                    block.by_default = False
            runs_without[techniques] = estimate(model, cfg, example_inputs=examples, example_kwargs=kw_examples,
                                                construction=construction, effects=effects, **common)
        return runs_without[techniques]

    unset = left_unset(config)
    unknown: list[str] = []  # (where the rank's memory is not known here, the techniques stay on, and it says so)

    def said(result: MemoryBudget) -> MemoryBudget:
        result.caveats += unknown
        return result

    if unset and default_policy(config, accelerator) == "where_needed":  # see note: techniques by default
        off = without(*unset)
        limit, source = (capacity, "given") if capacity is not None else rank_capacity(config, accelerator, world_size)
        if limit is not None and off.training_peak_bytes <= NEEDED_FROM * limit:
            why = (f"off: not needed, the run's predicted peak without it, {off.training_peak_bytes / 2**30:.3f} GiB, "
                   f"is within {NEEDED_FROM:.0%} of this rank's memory, {limit / 2**30:.3f} GiB ({source})")
            off.not_needed = {technique: why for technique in unset}
            return off
        if limit is None:
            unknown = [f"{' and '.join(unset)} run as where they pay: whether the run needs them is judged "
                       f"against this rank's memory, {source}; give zeroplus.memory_budget"]
    deciding = RECOMPUTE in unset
    if deciding:  # see note: recompute where it pays
        off = without(RECOMPUTE)
        bound = droppable_at_peak(off)
        if not recompute_pays(bound, off.steps_peak_bytes - bound):  # it cannot pay: the run with it not simulated
            off.stood_down = {**off.stood_down, RECOMPUTE: bound}
            return said(off)
    budget, resolved_cfg = _estimate(model, config, example_inputs=example_inputs, example_kwargs=example_kwargs,
                                     construction=construction, **common)
    if deciding and _recompute_chosen(off, budget, resolved_cfg, accelerator, config) is off:
        return said(off)
    if effects:
        def measure() -> dict[str, int]:
            return {technique: without(technique).training_peak_bytes - budget.training_peak_bytes
                    for technique in ACTIVATION_TECHNIQUES
                    if getattr(resolved_cfg.zeroplus, technique).enabled is True}
        budget.pending_effects = measure
    return said(budget)


def droppable_at_peak(off: MemoryBudget) -> int:
    """At most what resize recompute takes off the steps' peak of ``off`` (the run without it): what that run holds
    for backward at its peak (its activation row there). The run with it holds at each moment what ``off`` holds
    then, less what it dropped (saved for backward) and plus what it recomputes, so its peak is at least ``off``'s
    less this, and what it takes off at most this."""
    return off.phases[off.steps_peak_phase].get("activation", 0)


# resize recompute left unset runs where it lowers the steps' predicted peak by at least this fraction
RECOMPUTE_PAYS_FROM = 0.01


def recompute_pays(effect: int, peak: int) -> bool:
    """Whether resize recompute, on by default, stays on: it takes ``effect`` bytes off a predicted peak of the
    steps of ``peak`` bytes, at least ``RECOMPUTE_PAYS_FROM`` of it. Where it does not, it would cost its records and
    recomputes every step and keep no byte off the peak (the peak is elsewhere: model states, the step)."""
    return effect >= RECOMPUTE_PAYS_FROM * peak


LEAN = "lean_cross_entropy"
ROWS = "embedding_rows"
# under techniques_by_default "where_needed", the techniques left unset run only where the run's predicted training
# peak without them passes this fraction of the rank's memory (the budget's own tolerance, 5%, kept free)
NEEDED_FROM = 0.95


def left_unset(config: dict[str, Any] | str | ZeroplusConfig) -> list[str]:
    """The techniques the config leaves for the estimate to decide: resize recompute (``enabled`` unset, or an
    engine's resolved config marking it on ``by_default``), the lean loss (``lean_cross_entropy`` unset) and an
    embedding's gradient by rows (``embedding_rows`` unset)."""
    zp = load_config(config).zeroplus
    block = zp.resize_recompute
    recompute = block.enabled is None or (bool(getattr(block, "by_default", False)) and block.enabled is True)
    return [RECOMPUTE] * recompute + [LEAN] * (zp.lean_cross_entropy is None) + [ROWS] * (zp.embedding_rows is None)


def default_policy(config: dict[str, Any] | str | ZeroplusConfig, accelerator: str | None) -> str:
    """``zeroplus.techniques_by_default``, its ``"auto"`` the accelerator's (``Accelerator.techniques_by_default``)."""
    chosen = load_config(config).zeroplus.techniques_by_default
    return chosen if chosen != "auto" else techniques_by_default(accelerator or get_accelerator().name)


def rank_capacity(config: dict[str, Any] | str | ZeroplusConfig, accelerator: str | None,
                  world_size: int) -> tuple[int | None, str]:
    """The memory a rank trains in, and where it comes from: ``zeroplus.memory_budget``, else this machine's
    accelerator's (``capacity_bytes``, its host shared by ``LOCAL_WORLD_SIZE`` ranks, or all ``world_size``); None
    for a budget of another kind of device than this machine has."""
    budget = load_config(config).zeroplus.memory_budget
    if budget is not None:
        return parse_bytes(budget), "zeroplus.memory_budget"
    accel = get_accelerator()
    if accelerator not in (None, accel.name):
        return None, f"a {accelerator} device's, unknown on this machine"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return accel.capacity_bytes(ranks), (f"the {accel.name} device's" if not accel.host_is_device
                                         else f"this host's over {ranks} rank(s)")


ACTIVATION_TECHNIQUES = ("swap_attention", "resize_recompute")


def _estimate(model: torch.nn.Module | Callable[[], torch.nn.Module], config: dict[str, Any] | str | ZeroplusConfig,
              *, world_size: int, rank: int, micro_batch_size: int | None, seq_len: int | None,
              example_inputs: tuple[Any, ...] | None, example_kwargs: dict[str, Any] | None,
              loss_fn: Callable[[Any], torch.Tensor], accelerator: str | None,
              construction: str = "whole", code: int | None = None) -> tuple[MemoryBudget, Any]:
    """One simulation's budget, and the config as the simulated engine resolved it."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    kind = accelerator or get_accelerator().name
    parsed = load_config(config)  # (parsed once: the dtype and the profiler both read it)
    dtype = _compute_dtype_name(parsed)
    construction_runtime, training_runtime = runtime_bytes(kind, dtype, code, world_size,
                                                           parsed.flops_profiler.enabled)
    moments = parsed.zeroplus.optimizer_states
    if {moments.exp_avg, moments.exp_avg_sq} & {"fp8", "mxfp8"}:  # their step's code, from the first step on
        training_runtime += block_scaled_states_bytes(kind, dtype)
    tracker, cfg = simulate(model, config, world_size, rank, micro_batch_size=micro_batch_size, seq_len=seq_len,
                            example_inputs=example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                            workspace=cpu_workspace_bytes if kind == "cpu" else None,
                            runtime=(construction_runtime, training_runtime),
                            routed_kernels=kernel_cache_bytes(kind, dtype), construction=construction)
    # MKL's pool, from the first forward on (host_gemm_pool): initialize released the process's own before its start
    pool = pool_bytes(list(tracker.host_products)) if kind == "cpu" else 0
    phases = {}
    for phase in PHASES:
        peak = tracker.peaks[phase]
        entry = {c: peak.by_category.get(c, 0) for c in CATEGORIES}
        entry["total"] = peak.total
        if phase != "init":
            entry["runtime"] += pool
            entry["total"] += pool
        phases[phase] = entry
    with _quiet():
        states = model_state_bytes(model if not isinstance(model, torch.nn.Module) else _module_builder(model),
                                   cfg, world_size, rank)
    category_peaks = tracker.category_peaks  # while training; a save's copies are in checkpoint_copies
    return MemoryBudget(rank, world_size, cfg.train_micro_batch_size_per_gpu,
                        cfg.gradient_accumulation_steps, cfg.zero_optimization.stage, phases, states, kind,
                        category_peaks, tracker.saved_for_backward, tracker.checkpoint_copies, _split(cfg, world_size),
                        caveats=caveats(kind, dtype, tracker.run_op.routed, world_size), host_buffers=pool), cfg


def caveats(kind: str, dtype: str, routed: int, world_size: int = 1) -> list[str]:
    """What the prediction is known to leave out. A router's choice (``routed``: ``topk`` results the
    simulation made up) changes the experts' batch sizes every step; on CPU in 16 bits each new shape makes the
    matrix-product kernel caches keep a kernel, up to their capacities: the prediction counts them full from the
    first routing on where zeroplus bounds them (``host_kernel_cache.py``; the Hugging Face Mixtral ``small`` in
    bf16: -19.0% to -43.1% before, with the default 1024 entries), and says they grow beyond it where the process
    keeps larger ones (``host_kernel_cache.caveat``). fp32 (MKL's products) and accelerators: no such cache. On
    CPU, ``ZEROPLUS_HOST_ALLOCATOR=keep``, and a process's own ``MALLOC_*`` variables with an mmap threshold above
    zeroplus's, leave what glibc keeps out (``host_allocator.caveat``); on CPU ranks running collectives (``world_size``
    above 1), torch's flight recorder where it records (``flight_recorder.caveat``)."""
    found = []
    if routed and kind == "cpu" and dtype != "fp32":
        grows = kernel_cache_caveat()
        found += [grows] if grows else []
    kept = host_allocator_caveat() if kind == "cpu" else None
    recorded = flight_recorder.caveat(world_size) if kind == "cpu" else None
    return found + [text for text in (kept, recorded) if text]


def _compute_dtype_name(config: ZeroplusConfig) -> str:
    """``fp32``, ``bf16`` or ``fp16``: whose runtime overhead the run has (``runtime_overhead.py``), by the
    engine's own choice of compute dtype."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute_dtype(config), "fp32")


def _split(cfg: Any, world_size: int) -> str:
    topology = topology_of(cfg, world_size)
    return topology.describe() if (topology.tensor, topology.pipeline, topology.expert) != (1, 1, 1) else ""


def _module_builder(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """A function copying ``model`` to the meta device; called inside ``groups.using(stand-ins)``, the copy
    holds the stand-ins in place of this process's groups."""
    real = current_groups()
    return lambda: meta_copy(model, group_stand_ins(real, parallel_groups()))
