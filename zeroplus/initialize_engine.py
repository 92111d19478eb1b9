"""``zeroplus.initialize``: the top of the package, from a model and a DeepSpeed-style config to an engine.

The layers below run one way (config, partitioning and offload, engine, budget); this module is the
only one that uses them all. In order: parse the config (a path or a dict) and create the process
groups (with the collective timeout it asks for); resolve the batch triple against the data-parallel
size and every derivable ``"auto"``; check that every rank agrees on config and model
(``engine/rank_agreement.py``); let the planner resolve the remaining ``"auto"`` keys within
``zeroplus.memory_budget`` (rank 0 plans, every rank takes its choice); copy the model to the meta
device for the memory prediction; assemble the engine (``engine/build.py``) from the resolved config;
and install the prediction as the engine's first-forward hook, which runs ``zeroplus.estimate`` on the
meta copy with the first batch's shapes and stores the result as ``engine.budget``.
See note: first forward (docs/design-notes.md).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, cast

import torch

from . import fault_dumps
from .accelerator import get_accelerator
from .budget.estimate import RECOMPUTE, RECOMPUTE_PAYS_FROM, default_policy, estimate, left_unset
from .budget.first_use import code_resident
from .budget.planner import apply_settings, plan
from .budget.simulate import group_stand_ins, meta_copy
from .comm import DataParallelGroup, init_distributed_if_launched
from .config import (
    ConfigError,
    OptimizerConfig,
    ResolvedConfig,
    ZeroplusConfig,
    auto_keys,
    check_fillable,
    load_config,
    parse_config,
    resolve_auto,
    resolve_batch,
    resolved,
)
from .cpu_precision import warn_if_bf16_is_emulated
from .eager import compiled_modules, compiled_wrapper
from .engine.build import build_engine
from .engine.engine import Engine
from .engine.lifecycle import collecting_what_it_leaves
from .engine.rank_agreement import agree_on_budget, check_ranks_agree
from .logs import log_rank0, setup_logging
from .optim.build import describe_client_optimizer
from .parallel.autotp import Undo
from .parallel.groups import ParallelGroups, init_parallel, node_split, secondary_size, shard_size
from .parallel.plans import by_plans, split_by_own_plans, splits
from .zero.init_shards import shard_of

logger = logging.getLogger("zeroplus.engine")


def initialize(model: torch.nn.Module, config: dict[str, Any] | str | os.PathLike, *,
               optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
               model_parameters: Iterable[Any] | None = None, process_group: Any = None,
               init_fn: Callable[[torch.nn.Module], None] | None = None) -> Engine:
    """Wrap ``model`` for ZeRO training as ``config`` (a dict or JSON path) describes.

    ``model`` may be built normally (moved and partitioned one unit at a time), under ``zeroplus.Init``
    (its shards adopted) or on the meta device (given values at shard memory by replaying its
    initialisation: ``zero/meta_init.py``; ``init_fn(module)``, called over the modules after their
    ``reset_parameters()``, for what those do not set)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    # torch.compile(model): the engine works on the model inside (its own parameter and module names, as
    # checkpoints and name patterns expect them), and runs each forward through the compiled wrapper
    wrapper: torch.nn.Module | None = None
    if compiled_wrapper(model):
        wrapper, model = model, model.get_submodule("_orig_mod")
    accel = get_accelerator()
    cfg, unimplemented = parse_config(config)
    accel.release_host_memory()  # what the process freed before is not in the start (see note: host allocator)
    accel.reset_peak_memory_stats()  # the engine's peak is measured from here
    rss_at_start = accel.memory_allocated()
    predicts = (cfg.zeroplus.memory_estimate or cfg.zeroplus.memory_budget is not None) \
        and cfg.zeroplus.parallel.pipeline == 1  # (a pipeline stage is not estimated: _estimate_source)
    # torch's code this process holds already (budget/first_use.py): read only where a budget is made
    code = code_resident() if predicts and accel.name == "cpu" else None
    _set_up_process(cfg, accel, unimplemented)
    planned = _plans_before_groups(model, cfg)
    if planned:
        cfg = _plan(model, cfg, DataParallelGroup(label="world"), code)
    try:
        parallel = init_parallel(cfg)
    except ValueError as err:
        raise ConfigError(f"config key 'zeroplus.parallel': {err}") from None
    split = split_by_plans(model, parallel, cfg.zeroplus.parallel.expert_capacity_factor)
    try:
        return _assemble(model, cfg, parallel, accel, rss_at_start, code, wrapper, optimizer,
                         lr_scheduler, model_parameters, process_group, init_fn, planned)
    except ConfigError:  # refused before anything moved: the model as it was given, whole
        split.undo()
        raise


def _assemble(model: torch.nn.Module, cfg: Any, parallel: ParallelGroups, accel: Any, rss_at_start: int,
              code: int | None, wrapper: Any, optimizer: Any, lr_scheduler: Any,
              model_parameters: Any, process_group: Any, init_fn: Any, planned: bool = False) -> Engine:
    """``initialize`` from the parallel groups on: the batch and the planner's choices resolved, the engine built
    and its first-forward prediction attached. ``code``: torch's code this process held at the start
    (``estimate``'s ``code``). ``planned``: the planner chose the layout before the groups
    (a tensor size among them), and the config holds its choice."""
    context = parallel.topology.context
    # ZeRO partitions and averages over data x context; a batch is split over the data ranks only
    dp = DataParallelGroup(process_group) if process_group is not None else parallel.zero
    check_fillable(cfg)
    resolve_batch(cfg, dp.size // context, parallel.topology.tensor)
    compiled = wrapper is not None or bool(compiled_modules(model))
    recompute_unset = cfg.zeroplus.resize_recompute.enabled is None
    resolve_auto(cfg, model, optimizer is not None, compiled=compiled,
                 planned=cfg.zeroplus.memory_budget is not None)
    if dp.size > 1:
        check_ranks_agree(model, cfg, dp, parallel.topology.to_dict())
    if not planned:
        _check_budget_covers(cfg, parallel)
        cfg = _plan(model, cfg, dp, code)
    pipelined = parallel.topology.pipeline > 1
    cfg = resolved(cfg, recompute_unset=recompute_unset)  # frozen from here
    parallel, dp = _groups_of_plan(cfg, parallel, dp, process_group)
    _check_resolved(cfg, wrapper is not None, accel)
    # predicted at the first forward, from the shapes and dtypes of its real batch (whatever the model takes)
    source = _estimate_source(model, cfg, parallel, optimizer) if not pipelined else None
    engine = build_engine(model, cfg, dp, accel, rss_at_start, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          model_parameters=model_parameters, parallel=parallel, init_fn=init_fn, compiled=compiled)
    accel.release_host_memory()  # the whole parameters ZeRO freed (see note: host allocator)
    if source is not None:
        engine.before_first_forward(_predictor(*source, code))
    if wrapper is not None:
        engine.forward_through(wrapper)
    return engine


def _set_up_process(cfg: ZeroplusConfig, accel: Any, unimplemented: list[str]) -> None:
    """What the process needs before any group exists: torch.distributed (when launched), logging, the fault
    dumps' directory and memory history, and the warning naming DeepSpeed keys accepted but not honoured."""
    init_distributed_if_launched(cfg.zeroplus.collective_timeout)
    setup_logging(cfg.zeroplus.log_level)
    fault_dumps.set_dump_dir(cfg.zeroplus.dump_dir)
    if cfg.zeroplus.memory_history:
        fault_dumps.record_memory_history(accel)
    if unimplemented:
        log_rank0("config keys DeepSpeed knows but zeroplus does not implement yet (ignored): %s",
                  ", ".join(unimplemented), level=logging.WARNING)


def _plans_before_groups(model: torch.nn.Module, cfg: ZeroplusConfig) -> bool:
    """Whether the planner runs over the whole world before any group splits the model (see note: planner tensor
    size): 'auto' in ``tensor_parallel.autotp_size`` or ``expert_parallel.autoep_size``, or a memory budget beside
    tensor or expert sizes that split a Hugging Face model by its plans (the estimate simulates that split). zeroplus's
    own tensor-parallel and MoE layers are built inside the groups: a budget beside them stays refused
    (``_check_budget_covers``)."""
    if "auto" in (cfg.tensor_parallel.autotp_size, cfg.expert_parallel.autoep_size):
        return True
    par = cfg.zeroplus.parallel
    if cfg.zeroplus.memory_budget is None or par.pipeline > 1 or (par.tensor, par.expert) == (1, 1):
        return False
    tensor, expert = by_plans(model, par.tensor, par.expert)
    return (par.tensor == 1 or tensor) and (par.expert == 1 or expert)


def _check_budget_covers(cfg: ZeroplusConfig, parallel: ParallelGroups) -> None:
    """A memory budget or 'auto' keys only where the estimate and planner cover the split (data x context; a
    Hugging Face model split by its plans is planned before the groups: ``_plans_before_groups``)."""
    split = parallel.model.size > 1 or parallel.expert.size > 1
    if split and (auto_keys(cfg) or cfg.zeroplus.memory_budget is not None):
        raise ConfigError(f"config key 'zeroplus.memory_budget' with {parallel.topology.describe()}: the memory "
                          f"estimate and planner cover data and context parallelism only so far; remove the "
                          f"budget and 'auto'")


def _check_resolved(cfg: ResolvedConfig, compiled_wrapper_given: bool, accel: Any) -> None:
    """Refused: resize recompute under a ``torch.compile`` wrapper (see note: compilation); warned: bf16 on a CPU
    that emulates it."""
    if compiled_wrapper_given and cfg.zeroplus.resize_recompute.enabled:
        raise ConfigError("config key 'zeroplus.resize_recompute': resize_recompute does not work with compiled "
                          "modules (<model>: torch.compile(model) was given to initialize): a compiled graph's "
                          "backward reads the dropped outputs before they are recomputed. Turn it off, or do not "
                          "compile")
    if accel.name == "cpu" and cfg.bf16.enabled:
        warn_if_bf16_is_emulated()


def _plan(model: torch.nn.Module, cfg: ZeroplusConfig, dp: Any,
          code: int | None) -> ZeroplusConfig:
    """``zeroplus.memory_budget``: rank 0 of ``dp`` plans for its ranks (``zeroplus/budget/planner.py``) and every
    rank takes its choice, or raises its refusal, before anything is allocated. ``dp``: the data group, or the whole
    world where the plan chooses the tensor size too."""
    autos = auto_keys(cfg)
    if not autos and cfg.zeroplus.memory_budget is None:
        return cfg
    if autos and cfg.zeroplus.memory_budget is None:
        raise ConfigError(f"config keys {autos} are 'auto', which the planner resolves within config key "
                          f"'zeroplus.memory_budget': set it (e.g. '16GB') or give those keys values")
    if cfg.zeroplus.memory_budget is not None and dp.size > 1:
        cfg = agree_on_budget(cfg, dp)  # the smallest of the ranks' budgets holds on every rank
    outcome: Any = None
    if dp.rank == 0:
        with collecting_what_it_leaves():  # the simulations' reference cycles
            try:
                chosen = plan(meta_copy(model), cfg, world_size=dp.size, log=lambda m: log_rank0("%s", m),
                              code=code)
                outcome = (chosen.settings, chosen.reason)
            except ConfigError as err:
                outcome = str(err)
    outcome = dp.broadcast_object(outcome)
    if isinstance(outcome, str):
        raise ConfigError(outcome)
    settings, reason = outcome
    log_rank0("planner: %s", reason)
    return apply_settings(cfg, settings)


def _groups_of_plan(cfg: Any, parallel: ParallelGroups, dp: Any, process_group: Any) -> tuple[ParallelGroups, Any]:
    """The planner chose a layout with groups of its own ('auto' in ``mics_shard_size``, ``zero_hpz_partition_size`` or
    ``zero_quantized_gradients`` over nodes; see note: planner links): those groups, made now on every rank (each took
    rank 0's plan), and the data group again; else the groups as they are."""
    top = parallel.topology
    world = top.world_size
    if (top.shard, top.secondary, top.node) == (shard_size(cfg, world), secondary_size(cfg, world),
                                                node_split(cfg, world)):
        return parallel, dp
    parallel = init_parallel(cfg, replace=True)
    return parallel, DataParallelGroup(process_group) if process_group is not None else parallel.zero


def split_by_plans(model: torch.nn.Module, parallel: ParallelGroups, capacity_factor: float | None = None) -> Undo:
    """A tensor or expert size above 1: a Hugging Face model split by its own plans (``parallel/plans.py``), before
    anything reads the model; a plan it cannot split is a ConfigError naming the key and the rank, the model as it
    was. ``capacity_factor``: AutoEP's (``zeroplus.parallel.expert_capacity_factor``), refused where no experts are
    split by a plan (zeroplus's own MoE layers take theirs when built)."""
    top = parallel.topology
    if capacity_factor is not None and not (top.expert > 1 and splits(model, parallel)):
        raise ConfigError(f"config key 'zeroplus.parallel.expert_capacity_factor' is {capacity_factor} (rank "
                          f"{parallel.global_rank}), and no experts are split by a plan here (expert size "
                          f"{top.expert}, a {type(model).__name__}): it applies to a Hugging Face mixture of experts "
                          f"split by AutoEP; zeroplus's MoE layers take capacity_factor= when built")
    if splits(model, parallel) and any(shard_of(p) is not None for p in model.parameters()):
        raise ConfigError(f"the model was built under zeroplus.Init (its parameters partitioned), and the config asks "
                          f"for tensor size {top.tensor} / expert size {top.expert} (rank {parallel.global_rank}), "
                          f"which splits a Hugging Face model by its plans: not supported on partitioned parameters "
                          f"yet; build the model normally or on the meta device")
    try:
        return split_by_own_plans(model, parallel, capacity_factor)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _estimate_source(model: torch.nn.Module, cfg: ResolvedConfig, parallel: ParallelGroups,
                     optimizer: torch.optim.Optimizer | None) -> tuple[torch.nn.Module, ResolvedConfig] | None:
    """``zeroplus.memory_estimate``: a meta-device copy of the model as given and the config, to predict
    the memory with at the first forward. The copy keeps the model's process groups (the estimate swaps
    in stand-ins for the rank it simulates). A client ``optimizer`` (the Trainer's, given with a config
    that has no ``optimizer`` block) goes into the copy of the config as the block that builds one like
    it (``describe_client_optimizer``); one the budget cannot size is named in a warning."""
    if not cfg.zeroplus.memory_estimate:
        return None
    estimated = cast(ResolvedConfig, load_config(cfg))  # the run to simulate: a copy of the config, thawed
    if optimizer is not None:
        try:
            kind, params = describe_client_optimizer(optimizer)
        except ValueError as err:
            log_rank0("memory estimate unavailable: %s", err, level=logging.WARNING)
            return None
        estimated.optimizer = OptimizerConfig(type=kind, params=params)
    try:  # each group stands in for itself: the copy keeps them, uncopied
        return meta_copy(model, group_stand_ins(parallel, parallel)), estimated
    except Exception as err:  # noqa: BLE001 - a module that cannot be copied: train without the prediction
        log_rank0("memory estimate unavailable: the model cannot be copied to the meta device (%s: %s)",
                  type(err).__name__, err, level=logging.WARNING)
        return None


def _predictor(model: torch.nn.Module, cfg: ResolvedConfig, code: int | None):
    """The first-forward hook: this rank's memory budget for inputs shaped like the first batch
    (``zeroplus.estimate`` on the meta copy, with torch's code this process held at ``initialize``; MKL's
    pool was released there); rank 0 logs it. A model the estimator cannot run is trained anyway."""
    def predict(engine: Engine, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        par = engine.parallel  # with tensor or expert parallelism: this rank of the whole world
        world, rank = ((par.topology.world_size, par.global_rank) if par is not None
                       else (engine.dp.size, engine.dp.rank))
        recompute = cfg.zeroplus.resize_recompute
        if recompute.by_default and (engine.is_compiled or compiled_modules(engine.module)):
            recompute.enabled = False  # (it stands down at this forward: see note: recompute by default)
        # what the budget may stand down (the same on every rank: configs agree): recompute, and where the device's
        # rule is "where needed" the lean loss too (see note: techniques by default)
        needed_only = default_policy(cfg, get_accelerator().name) == "where_needed"
        deciding = [t for t in left_unset(cfg) if t == RECOMPUTE or needed_only]
        with collecting_what_it_leaves():  # the simulation's reference cycles, freed before the real forward
            try:
                budget = estimate(model, cfg, world_size=world, rank=rank, effects=True, example_inputs=args,
                                  example_kwargs=kwargs, code=code)
            except Exception as err:  # noqa: BLE001 - the prediction must never stop training
                logger.warning("memory estimate unavailable (%s: %s); zeroplus.memory_estimate false skips it",
                               type(err).__name__, err)
                budget = None
        if deciding:  # see notes: recompute where it pays, techniques by default
            _stand_down(engine, budget, deciding)
        if budget is None:
            return
        budget.compiled = engine.is_compiled or bool(compiled_modules(engine.module))
        engine.record_budget(budget)
        if engine.dp.rank == 0:
            logger.info("%s", budget)
            for caveat in budget.caveats:
                logger.warning("memory budget, not predicted: %s", caveat)
    return predict


def _stand_down(engine: Engine, budget: Any, techniques: list[str]) -> None:
    """Turn each of ``techniques``, on by default, off where ``budget`` (this rank's, None if it failed) found the
    run fits without it (``not_needed``) or, for resize recompute, that it takes under ``RECOMPUTE_PAYS_FROM`` off
    the peak; kept on every rank if any rank keeps it (or has no budget), so the ranks run alike. One flag's
    all-reduce over the data group per technique (see notes: recompute where it pays, techniques by default)."""
    for technique in techniques:
        why = None if budget is None else budget.not_needed.get(technique)
        if why is None and budget is not None and technique in budget.stood_down:
            effect = budget.stood_down[technique]
            why = (f"off: it would take at most {effect / 2**20:.1f} MiB off this rank's predicted training peak of "
                   f"{(budget.steps_peak_bytes - effect) / 2**20:.1f} MiB, under {100 * RECOMPUTE_PAYS_FROM:g}%")
        if engine.dp.max_flag(why is None) or why is None:  # (the second: only where the first is, for the checker)
            if budget is not None:  # (kept: the budget's phases, without it, over-predict)
                budget.stood_down.pop(technique, None)
                budget.not_needed.pop(technique, None)
            continue
        engine.choices[technique].stand_down(why)  # (it stands down at this forward's start)
        key = "resize_recompute.enabled" if technique == RECOMPUTE else technique
        log_rank0("%s (on by default) is %s (set zeroplus.%s true to keep it)", technique, why, key)


__all__ = ["initialize"]
