"""Assembling an ``Engine`` from a model and a resolved config (``build_engine``).

The one place an engine is put together, used by ``zeroplus.initialize`` (``initialize_engine.py``,
the top layer, which parses, resolves, plans and installs the first-forward prediction before calling
it) and by the memory budget's meta-device simulation (``budget/simulate.py``). Order: partition
(``make_partition``), which moves the model to the device and the compute dtype one unit at a time
(``zero/placement.py``: each unit's tensors moved or copied into its flat buffer, broadcast from the
first rank so every rank starts alike, sharded, and the unit's full copy freed before the next;
buffers, masters and shards allocated through the ledger); build or adopt the optimizer over the
master shards; build the schedule. Nothing here reads ``"auto"`` or imports the budget.
See note: untrained parameters (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator

import torch

from zeroplus.accelerator import Accelerator
from zeroplus.activations.choices import TechniqueChoice, technique_choices
from zeroplus.activations.tiled_loss import is_hf_causal_lm
from zeroplus.collectives import Collectives
from zeroplus.config import ConfigError, ResolvedConfig, ZeroplusConfig, ZeroStage, resolved_zero
from zeroplus.ledger import Ledger
from zeroplus.logs import log_rank0
from zeroplus.models.context_hf import context_parallel_hf
from zeroplus.offload.policies import MasterPolicy, ParamOffload
from zeroplus.optim.muon import split_groups
from zeroplus.parallel.dropless_moe import DroplessMoE
from zeroplus.parallel.groups import ParallelGroups, node_ranks, ranks_per_node
from zeroplus.parallel.moe import is_expert
from zeroplus.parallel.pipeline import PipelineModule
from zeroplus.parallel.plan_slices import slicer, slicing
from zeroplus.parallel.tensor_layers import is_tensor_parallel
from zeroplus.parallel.topology import check_supported
from zeroplus.zero import ShardedStep, ZeroPartition
from zeroplus.zero.init_shards import shard_of
from zeroplus.zero.meta_init import has_meta_tensors, materialize_meta
from zeroplus.zero.partition import ExpertSplit
from zeroplus.zero.placement import UnitPlacement
from zeroplus.zero.quantized import packed_storage
from zeroplus.zero.sharded_step import ModelParallelNorm, StepPolicy
from zeroplus.zero.units import frozen_dtype

from .activation_setup import assemble_activations, remember_roles
from .embedding_tables import check_tables
from .engine import Engine, TrainingParts
from .loss_scaler import LossScaler
from .monitors import check_packages
from .offload_setup import optimizer_offload, param_offload_of, virtual_states
from .optimizer_setup import check_optimizer_request, masters_in_bf16, muon_params, optimizer_and_schedule

logger = logging.getLogger("zeroplus.engine")


def compute_dtype(cfg: ZeroplusConfig) -> torch.dtype:
    if cfg.fp16.enabled is True and cfg.bf16.enabled is True:
        raise ConfigError("config enables both fp16 and bf16; enable at most one")
    if cfg.fp16.enabled is True:
        return torch.float16
    if cfg.zeroplus.shared_master_weights and cfg.bf16.enabled is not True:
        raise ConfigError("config key 'zeroplus.shared_master_weights' is true, which needs bf16 training "
                          "('bf16': {'enabled': true}); fp16 and fp32 masters cannot be split into halves")
    if cfg.bf16.enabled is True:
        return torch.bfloat16
    return torch.float32


def bf16_masters(cfg: ZeroplusConfig, rank: int | None = None) -> str | None:
    """The rounding of bf16 master weights where the config asks for them (``zeroplus.master_weights.dtype``, unset:
    DeepSpeed's ``bf16.bf16_master_weights_and_grads``), else None; ConfigError where they cannot be served."""
    block = cfg.zeroplus.master_weights
    key = ("zeroplus.master_weights.dtype" if block.dtype is not None else "bf16.bf16_master_weights_and_grads")
    key += "'" if rank is None else f"' on rank {rank}"
    if not masters_in_bf16(cfg):
        return None
    if cfg.bf16.enabled is not True:
        raise ConfigError(f"config key '{key} asks for bf16 master weights, which need bf16 training "
                          f"('bf16': {{'enabled': true}}; fp16 is {cfg.fp16.enabled}, bf16 {cfg.bf16.enabled})")
    zero = cfg.zero_optimization
    clashes = [name for name, on in [
        ("zeroplus.shared_master_weights", cfg.zeroplus.shared_master_weights is True),
        ("zero_optimization.offload_param", zero.offloads_params),
        ("zeroplus.virtual_optimizer_states", cfg.zeroplus.virtual_optimizer_states)] if on]
    if clashes:
        raise ConfigError(f"config key '{key} asks for bf16 master weights, which do not combine with {clashes} "
                          f"(an exact master in 2 more bytes: zeroplus.shared_master_weights alone)")
    return block.rounding


def _param_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Parameter groups as dicts (``params`` plus per-group options), in the optimizer's order."""
    if optimizer is not None:
        return [dict(g) for g in optimizer.param_groups]
    if model_parameters is None:
        return [{"params": list(model.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(g, params=list(g["params"])) for g in items]
    return [{"params": items}]


def _choose_transport(cfg: ResolvedConfig, dp: Collectives, parallel: ParallelGroups | None,
                      experts: ExpertSplit | None, ledger: Ledger) -> str:
    """``zeroplus.transport`` on every group this engine moves bytes over (``comm.py``, ``use_transport``): the
    data group, the only one that may map the shared pair, then the expert, tensor and context groups
    (``pair`` is ``gloo`` there). Decided here, once; the layers above ask the group for semantic
    operations and never see the transport or the backend.
    Returns the data group's transport."""
    wanted = cfg.zeroplus.transport
    others = [] if parallel is None else [parallel.data, parallel.zero, parallel.tensor, parallel.context,
                                          parallel.context_ulysses, parallel.context_ring, parallel.expert,
                                          parallel.expert_data, parallel.shard, parallel.replica, parallel.secondary,
                                          parallel.node, parallel.across]
    if experts is not None:
        others.append(experts.group)
    try:
        chosen = dp.use_transport(wanted, ledger, cfg.zeroplus.shared_memory_pair)
        done = {id(dp)}
        for group in others:
            if id(group) in done or getattr(group, "size", 1) == 1:
                continue
            done.add(id(group))
            group.use_transport("gloo" if wanted == "pair" else wanted, ledger, shared_pair=False)
    except ValueError as err:
        raise ConfigError(f"config key 'zeroplus.transport' is {wanted!r}: {err}") from None
    nodes = ranks_per_node(cfg)
    for group in [dp, *others]:
        group.place(nodes)
    return chosen


def _broadcast_group(dp: Collectives, experts: ExpertSplit | None) -> Callable[[torch.Tensor], Any]:
    """Whose first rank's values a tensor takes: its expert-data group's for an expert's tensors
    (they differ between expert ranks), else the data group's."""
    def group_of(tensor: torch.Tensor) -> Any:
        return experts.group if experts is not None and experts.holds(tensor) else dp
    return group_of


def _check_lending(model: torch.nn.Module, cfg: ResolvedConfig) -> None:
    """Lent experts (``DroplessMoE(hot_experts=...)``) read their parameters outside their module's forward,
    where ZeRO-3 has not gathered them: refused there, naming the modules."""
    lenders = [n or "<root>" for n, m in model.named_modules() if isinstance(m, DroplessMoE) and m.hot_experts]
    if lenders and cfg.zero_optimization.stage == 3:
        raise ConfigError(f"config key 'zero_optimization.stage' is 3 and {lenders} lend their hot experts "
                          f"(hot_experts): the lent parameters are read outside the experts' forward, where ZeRO-3 "
                          f"has not gathered them; use stage 0-2 or hot_experts=0")


def expert_split(parallel: ParallelGroups | None) -> ExpertSplit | None:
    """Experts split over ranks: their parameters are partitioned over the expert-data group."""
    if parallel is None or parallel.expert.size == 1:
        return None
    span = parallel.tensor.size if parallel.topology.experts_span_tensor else 1
    return ExpertSplit(parallel.expert_data, parallel.expert.rank, parallel.expert.size, is_expert, span)


def _norm_split(experts: ExpertSplit | None, stage: ZeroStage) -> Callable[[torch.Tensor], bool]:
    """Which parameters the gradient norm counts whole on each tensor rank (``ModelParallelNorm``): the
    tensor-parallel ones, and in the expert-data mode at stages 1-3 the experts (each expert's shards lie on
    ranks of different tensor ranks, once each); at stage 0 the experts' part is summed over the expert group,
    which spans the tensor ranks, so it counts 1/T on each as a replicated parameter does."""
    if experts is None or experts.tensor_span == 1 or not stage.partitions:
        return is_tensor_parallel
    return lambda p: is_tensor_parallel(p) or experts.holds(p)


def build_engine(model: torch.nn.Module, cfg: ResolvedConfig, dp: Collectives, accel: Accelerator, rss_at_start: int, *,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None,
                 model_parameters: Iterable[Any] | None = None, ledger: Ledger | None = None,
                 simulated: Any = None, parallel: ParallelGroups | None = None,
                 init_fn: Callable[[torch.nn.Module], None] | None = None, compiled: bool = False) -> Engine:
    """The engine over ``dp`` (a ``DataParallelGroup``, or the estimator's ``VirtualGroup``) on
    ``accel``'s device, from a parsed and resolved config (batch triple and ``"auto"`` resolved by
    the caller); everything after process-group set-up.
    ``simulated``: the estimator's memory tracker when this is its meta-device run
    (``zeroplus/budget/simulate.py``), else None. ``parallel``: the tensor/pipeline/expert groups
    (``zeroplus/parallel/groups.py``) when the model is split beyond ``dp``. A model on the meta device is
    given its values first (``zero/meta_init.py``, with ``init_fn``), at the memory of its shards."""
    model_parallel = parallel is not None and parallel.model.size > 1
    split = model_parallel or (parallel is not None and parallel.expert.size > 1)  # beyond data parallelism
    _check_and_warn(model, cfg, dp, parallel, optimizer, lr_scheduler, simulated)
    model_bytes = _device_bytes(model, accel)  # already there: they count as the engine's, as in the estimate
    dtype = compute_dtype(cfg)
    experts = expert_split(parallel)
    zero = _partition_group(model, cfg, dp, parallel, simulated is not None)
    secondary = _secondary_group(cfg, dp, parallel)
    _check_quantized(cfg, parallel.global_rank if parallel is not None else dp.rank)
    if simulated is None and has_meta_tensors(model):  # (the estimator's models are meta by design)
        of = _split_by_plan_alone(model, parallel) if split else None
        if optimizer is not None or model_parameters is not None or (split and of is None):
            raise ConfigError("a model on the meta device gets new parameters from initialize(): give the optimizer "
                              "in the config rather than optimizer=/model_parameters=, and build models split by "
                              "tensor, pipeline or expert parallelism normally (not supported on meta yet, but for "
                              "a Hugging Face model split by its plans, AutoTP and AutoEP)")
        materialize_meta(model, dp, accel.device(), init_fn, slice_of=None if of is None else slicer(of))
    groups = _trained_groups(model, cfg, optimizer, lr_scheduler, model_parameters)
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    ledger = Ledger() if ledger is None else ledger
    _choose_transport(cfg, dp, parallel, experts, ledger)
    param_offload = param_offload_of(cfg, model, group_of, zero.size, accel, ledger)
    stage = ZeroStage(cfg.zero_optimization.stage)
    remember_roles(model, cfg)
    flattened = {id(p) for p in model.parameters() if (p.requires_grad and id(p) in group_of)
                 or frozen_dtype(p, stage, experts, dtype) is not None}  # (units.py)
    choices = technique_choices(cfg)  # (the engine's decisions: the partition reads embedding_rows)
    try:
        partition = make_partition(model, cfg, zero, ledger, dtype, group_of, param_offload, experts,
                                   UnitPlacement(accel.device(), dtype, _broadcast_group(dp, experts), flattened),
                                   secondary, _node_groups(zero, parallel),
                                   replicas=parallel.topology.replicas if parallel is not None else 1,
                                   rows=choices["embedding_rows"])
    except OSError as err:  # writing the offloaded shards failed (a full disk)
        if param_offload is None:
            raise
        block = cfg.zero_optimization.offload_param
        raise ConfigError(f"config key 'zero_optimization.offload_param.nvme_path' "
                          f"({block.nvme_path if block else None!r}) on rank {dp.rank}: {err}") from None
    with _given_back_on_failure(partition):
        opt, scheduler = optimizer_and_schedule(cfg, partition, groups, optimizer, lr_scheduler, simulated)
        loss_scaler = LossScaler(cfg.fp16)
        step = _sharded_step(cfg, partition, opt, zero, ledger, accel, parallel, experts, not loss_scaler.dynamic)
        context = parallel.topology.context if parallel is not None else 1
        _log_assembly(cfg, partition, opt, dp, dtype, context, parallel if split else None)
        _log_layout_over_nodes(cfg, parallel)
        activations = assemble_activations(model, cfg, ledger, accel, context,
                                           [u.module for u in partition.units if not u.is_root], compiled, choices)
        parts = TrainingParts(partition, step, opt, scheduler, loss_scaler, activations, choices)
        if context > 1 and parallel is not None:
            _split_sequences(model, parallel)
        return Engine(model, cfg, parts, dp, ledger, accel, rss_at_start - model_bytes, parallel,
                      observed=simulated is None)


def _partition_group(model: torch.nn.Module, cfg: ResolvedConfig, dp: Collectives,
                     parallel: ParallelGroups | None, simulated: bool) -> Collectives:
    """What ZeRO partitions over: ``dp``, or under MiCS (``zero_optimization.mics_shard_size``) this rank's shard
    group, whose replicas average the gradients before the step (see note: mics). Refused where MiCS cannot run yet:
    stage 0 (nothing to shard), a process group of the caller's, a model on the meta device or built under
    ``zeroplus.Init`` (chunked over every rank, not a shard group; ``simulated``: the estimate's meta copy is not
    such a model)."""
    if parallel is None or not parallel.topology.shard:
        return dp
    where = (f"config key 'zero_optimization.mics_shard_size' is {parallel.topology.shard} (rank "
             f"{parallel.global_rank})")
    if not ZeroStage(cfg.zero_optimization.stage).partitions:
        raise ConfigError(f"{where}, and ZeRO stage 0 shards nothing: use stage 1, 2 or 3")
    if dp is not parallel.zero:
        raise ConfigError(f"{where}, and initialize() was given its own process group: MiCS makes its groups from "
                          f"the launch's ranks")
    if any((p.device.type == "meta" and not simulated) or shard_of(p) is not None for p in model.parameters()):
        raise ConfigError(f"{where}, and the model was built on the meta device or under zeroplus.Init, which MiCS "
                          f"does not take yet: build it normally")
    return parallel.shard


def _check_quantized(cfg: ResolvedConfig, rank: int) -> None:
    """ZeRO++'s quantized collectives where they have something to quantize: qwZ (``zero_quantized_weights``) at stage 3
    (stages 0-2 gather no parameters for compute; their post-step all-gathers write the weights the model keeps), qgZ
    (``zero_quantized_gradients``) on the reduce-scatter of stages 1-3. Refused otherwise, naming the key."""
    zero = cfg.zero_optimization
    stage = ZeroStage(zero.stage)
    if zero.zero_quantized_weights and not stage.shards_parameters:
        raise ConfigError(f"config key 'zero_optimization.zero_quantized_weights' is true (rank {rank}), and ZeRO "
                          f"stage {int(stage)} gathers no parameters for compute: qwZ quantizes stage 3's gathers; "
                          f"use stage 3, or set the key to false")
    if zero.zero_quantized_nontrainable_weights and not stage.shards_parameters:
        raise ConfigError(f"config key 'zero_optimization.zero_quantized_nontrainable_weights' is true (rank {rank}), "
                          f"and ZeRO stage {int(stage)} keeps frozen parameters whole on every rank: the key stores "
                          f"stage 3's frozen shards as int8 codes; use stage 3, or set the key to false")
    # (at stage 3 qgZ's all-to-all is the reduction whatever reduce_scatter says, as in DeepSpeed, whose stage 3
    # always partitions the gradients: its ZeRO++ tutorial sets reduce_scatter false beside qgZ)
    if zero.zero_quantized_gradients and not (stage.partitions and (zero.reduce_scatter or stage.shards_parameters)):
        why = "stage 0 all-reduces" if not stage.partitions else "'zero_optimization.reduce_scatter' false all-reduces"
        raise ConfigError(f"config key 'zero_optimization.zero_quantized_gradients' is true (rank {rank}), and {why} "
                          f"the gradients: qgZ quantizes the reduce-scatter of stages 1-3; use it, or set the key to "
                          f"false")
    if zero.zero_quantized_gradients and not zero.reduce_scatter and stage.shards_parameters:
        log_rank0("zero_optimization.zero_quantized_gradients at stage 3: the gradients are reduced by qgZ's "
                  "quantized all-to-all, and reduce_scatter false (an all-reduce) gives way to it, as in DeepSpeed")


def _secondary_group(cfg: ResolvedConfig, dp: Collectives, parallel: ParallelGroups | None) -> Collectives | None:
    """hpZ's group (``zero_optimization.zero_hpz_partition_size``): the ranks a stage-3 unit's secondary copy is split
    over (see note: hpz), or None. Refused where hpZ cannot run: stages 0-2 (their parameters are whole on every rank:
    nothing is gathered), a process group of the caller's."""
    if parallel is None or not parallel.topology.secondary:
        return None
    where = (f"config key 'zero_optimization.zero_hpz_partition_size' is {parallel.topology.secondary} (rank "
             f"{parallel.global_rank})")
    stage = ZeroStage(cfg.zero_optimization.stage)
    if not stage.shards_parameters:
        raise ConfigError(f"{where}, and ZeRO stage {int(stage)} gathers no parameters: hpZ's secondary copy serves "
                          f"stage 3's gathers; use stage 3, or leave the key at 1")
    if dp is not parallel.zero:
        raise ConfigError(f"{where}, and initialize() was given its own process group: hpZ makes its groups from the "
                          f"launch's ranks")
    return parallel.secondary


def _node_groups(zero: Collectives, parallel: ParallelGroups | None) -> tuple[Collectives, Collectives] | None:
    """Two-level collectives (qgZ's, see note: qgz; MiCS's gather, see note: mics hierarchical gather): this rank's
    node and the ranks at its place in every node of the group ZeRO partitions over (``zero``), where the topology has
    nodes (``parallel.groups.node_split``) and ``zero`` is its shard group (the zero group without MiCS); else None
    (one level)."""
    if parallel is None or not parallel.topology.node:
        return None
    if zero is not (parallel.shard if parallel.topology.shard else parallel.zero):
        return None
    return parallel.node, parallel.across


def _split_by_plan_alone(model: torch.nn.Module, parallel: Any) -> Any:
    """Each parameter's slicing for a model split by its Hugging Face plans alone (AutoTP, AutoEP), else None."""
    try:
        return slicing(model, parallel, "a meta-device model")
    except ValueError:
        return None


def _check_and_warn(model: torch.nn.Module, cfg: ResolvedConfig, dp: Collectives, parallel: ParallelGroups | None,
                    optimizer: torch.optim.Optimizer | None, lr_scheduler: Any, simulated: Any) -> None:
    """Everything refused before the model is touched (each naming its key and rank), then what is warned."""
    rank = parallel.global_rank if parallel is not None else dp.rank
    _check_request(model, cfg, parallel, optimizer, lr_scheduler, rank)
    check_tables(model, cfg, dp, parallel)
    _check_lending(model, cfg)
    if simulated is None:
        check_packages(cfg, rank)
    _warn_inert_options(cfg)
    _warn_flat_mics_gathers(cfg, parallel)
    _warn_mixed_dtypes(model, compute_dtype(cfg))


def _trained_groups(model: torch.nn.Module, cfg: ResolvedConfig, optimizer: torch.optim.Optimizer | None,
                    lr_scheduler: Any, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """The optimizer's param groups (none: a forward-only engine, ``optim/forward_only.py``), and what a user is told
    about the parameters outside them."""
    forward_only = optimizer is None and cfg.optimizer is None
    if forward_only and lr_scheduler is not None:
        raise ConfigError("an lr_scheduler was passed to initialize() without an optimizer (no 'optimizer' block, "
                          "no optimizer=): give the optimizer too")
    groups = [] if forward_only else _param_groups(model, optimizer, model_parameters)
    if optimizer is None and cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":
        groups = split_groups(groups, muon_params(model), dict(cfg.optimizer.params))
    trained = {id(p) for g in groups for p in g["params"]}
    untrained = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in trained]
    if forward_only:
        log_rank0("no optimizer (no 'optimizer' block, no optimizer=): a forward-only engine; its %d parameters are "
                  "kept as frozen parameters are, with no gradient, master or optimizer state",
                  len(list(model.parameters())))
    elif untrained:
        log_rank0("parameters that require grad but are in no optimizer group stay fixed: %s", untrained[:8],
                  level=logging.WARNING)
    return groups


def _sharded_step(cfg: ResolvedConfig, partition: ZeroPartition, opt: torch.optim.Optimizer, dp: Collectives,
                  ledger: Ledger, accel: Accelerator, parallel: ParallelGroups | None, experts: ExpertSplit | None,
                  scalars_on_device: bool) -> ShardedStep:
    """The optimizer step over the partition's shards, with the offload, clipping and model-parallel norm the config
    and the groups ask for."""
    model_parallel = parallel is not None and parallel.model.size > 1
    return ShardedStep(partition, opt, dp, ledger, StepPolicy(
        gradient_clipping=cfg.gradient_clipping, master_chunk_numel=cfg.zeroplus.master_step_chunk,
        offload=optimizer_offload(cfg, accel, ledger, opt, sum(g.owned_numel for g in partition.groups)),
        virtual_kernels=virtual_states(cfg, accel, opt),
        model_parallel=ModelParallelNorm(parallel.model, parallel.tensor.size,
                                         _norm_split(experts, ZeroStage(cfg.zero_optimization.stage)))
        if parallel is not None and model_parallel else None,
        expert_group=parallel.expert if parallel is not None and experts is not None else None,
        replicas=parallel.replica if parallel is not None and parallel.topology.shard else None,
        scalars_on_device=scalars_on_device))


def _log_assembly(cfg: ResolvedConfig, partition: ZeroPartition, opt: torch.optim.Optimizer, dp: Collectives,
                  dtype: torch.dtype, context: int, split: ParallelGroups | None) -> None:
    """Rank 0's line of what was assembled (``context``: ranks per sequence); ``split``: the groups when the model is
    split beyond data parallelism."""
    log_rank0("%s; compute dtype %s; optimizer %s; micro-batch %s x accumulation %s x data %d = batch %s%s",
              partition.describe().splitlines()[0], str(dtype).replace("torch.", ""), type(opt).__name__,
              cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, dp.size // context,
              cfg.train_batch_size, f" (each sequence over {context} context ranks)" if context > 1 else "")
    if split is not None:
        log_rank0("%s", split.describe())
        if cfg.zeroplus.memory_estimate and split.topology.pipeline > 1:
            log_rank0("memory estimate: not made for a pipeline stage at initialize (it needs every stage's "
                      "shapes; zeroplus estimate with a model factory predicts it); the report shows what is "
                      "measured")


def _log_layout_over_nodes(cfg: ResolvedConfig, parallel: ParallelGroups | None) -> None:
    """Rank 0's line of the layout over nodes (MiCS, hpZ, two-level collectives) and ZeRO++'s quantized collectives,
    where any is on (``docs/nodes.md``)."""
    zero, topology = cfg.zero_optimization, parallel.topology if parallel is not None else None
    parts = []
    if topology is not None and topology.shard:
        parts.append(f"MiCS shards within groups of {topology.shard} ranks, {topology.replicas} replicas")
    if topology is not None and topology.secondary:
        parts.append(f"hpZ keeps a secondary copy over {topology.secondary} ranks")
    if topology is not None and topology.node:
        parts.append(f"two-level collectives over nodes of {topology.node} ranks")
    parts += [text for on, text in ((zero.zero_quantized_weights,
                                     f"qwZ: {cfg.zeroplus.quantized_weights_dtype} weight gathers"),
                                    (zero.zero_quantized_gradients,
                                     f"qgZ: int{cfg.zeroplus.quantized_gradient_bits} gradient reductions"),
                                    (zero.zero_quantized_nontrainable_weights, "frozen shards as int8 codes"))
              if on]
    if parts:
        log_rank0("over nodes of %d ranks: %s", ranks_per_node(cfg), "; ".join(parts))


@contextlib.contextmanager
def _given_back_on_failure(partition: ZeroPartition) -> Iterator[None]:
    """A failure after the partition is built does not leave the model partitioned by an engine that never was:
    the hooks come off (no collective: the failure may be this rank's alone). At stages 0-2 the parameters keep
    their values; at stage 3 the released ones were on the shards, and a later initialize refuses them."""
    try:
        yield
    except BaseException:
        partition.drop_hooks()
        raise


def _check_request(model: torch.nn.Module, cfg: ResolvedConfig, parallel: ParallelGroups | None,
                   optimizer: torch.optim.Optimizer | None, lr_scheduler: Any, rank: int) -> None:
    """Refuse what cannot be assembled, before anything is moved or allocated."""
    if parallel is not None:
        try:
            check_supported(parallel.topology, cfg.zero_optimization.stage)
        except ValueError as err:
            raise ConfigError(f"config key 'zeroplus.parallel' on rank {parallel.global_rank}: {err}") from None
        if parallel.topology.pipeline > 1:
            _check_pipeline(model, cfg, parallel)
        _check_split(model, parallel)
    check_optimizer_request(cfg, optimizer, lr_scheduler, rank)
    bf16_masters(cfg, rank)


def make_partition(model: torch.nn.Module, cfg: ZeroplusConfig, dp: Collectives, ledger: Ledger, dtype: torch.dtype,
                   group_of: dict[int, int], param_offload: ParamOffload | None,
                   experts: ExpertSplit | None, placement: UnitPlacement | None = None,
                   secondary: Collectives | None = None,
                   nodes: tuple[Collectives, Collectives] | None = None, replicas: int = 1,
                   rows: TechniqueChoice | None = None) -> ZeroPartition:
    """The partition of ``model`` as ``cfg`` asks (the engine's, and the budget's model-state count's, whose
    config has the ZeRO block resolved but may lack a batch triple). ``placement``: the engine moves the
    model to the device and dtype through it, one unit at a time (``zero/placement.py``). ``secondary``: hpZ's
    group (``_secondary_group``); ``nodes``: two-level collectives (``_node_groups``); ``replicas``: MiCS's shard
    groups ``dp`` is one of; ``rows``: the engine's choice of embedding rows (None: always)."""
    accumulation = cfg.gradient_accumulation_steps if isinstance(cfg.gradient_accumulation_steps, int) else 1
    return ZeroPartition(model, resolved_zero(cfg.zero_optimization), dp, ledger, dtype, group_of,
                         cfg.zeroplus.unit_modules, accumulation,
                         MasterPolicy(bool(cfg.zeroplus.shared_master_weights),
                                      cfg.zeroplus.master_rounding == "like_shared", param_offload,
                                      bf16_masters(cfg), cfg.zero_optimization.zero_quantized_nontrainable_weights),
                         experts=experts, placement=placement,
                         defer_param_gather=cfg.zeroplus.overlap_param_gather, secondary=secondary, nodes=nodes,
                         gradient_bits=cfg.zeroplus.quantized_gradient_bits,
                         weights_dtype=cfg.zeroplus.quantized_weights_dtype, replicas=replicas, rows=rows)


def _check_split(model: torch.nn.Module, parallel: ParallelGroups) -> None:
    """A tensor or expert size above 1 needs a model zeroplus splits that way: otherwise every rank of the group would
    compute the whole model while the config names a layout it does not get (and data parallelism would lose those
    ranks). Tensor: zeroplus's tensor-parallel layers (``zeroplus.parallel``'s ``ColumnParallelLinear``,
    ``RowParallelLinear``, ``VocabParallelEmbedding``; ``TensorParallelGPT.from_dense``; a Hugging Face model split by
    its config's plan at ``initialize``, ``parallel/autotp.py``); experts: its ``MoE`` or ``DroplessMoE`` layers, or a
    Hugging Face mixture of experts split by its plan (``parallel/autoep.py``).
    Refused on every rank, before anything moves."""
    params = list(model.parameters())
    top, kind = parallel.topology, type(model).__name__
    if top.tensor > 1 and not any(is_tensor_parallel(p) for p in params):
        raise ConfigError(
            f"config key 'tensor_parallel.autotp_size' / 'zeroplus.parallel.tensor' is {top.tensor} (rank "
            f"{parallel.global_rank}), and the model, a {kind}, has no tensor-parallel layer: zeroplus splits only "
            f"models built from zeroplus.parallel's ColumnParallelLinear, RowParallelLinear and "
            f"VocabParallelEmbedding (zeroplus.models.gpt_tp.TensorParallelGPT.from_dense), and Hugging Face "
            f"models by the tensor-parallel plan of their config, which this one lacks (no base_model_tp_plan). "
            f"Use tensor size 1: every rank then trains as a data-parallel rank")
    if top.expert > 1 and not any(is_expert(p) for p in params):
        raise ConfigError(
            f"config key 'expert_parallel.autoep_size' / 'zeroplus.parallel.expert' is {top.expert} (rank "
            f"{parallel.global_rank}), and the model, a {kind}, has no expert layer zeroplus splits: expert "
            f"parallelism needs zeroplus.parallel's MoE or DroplessMoE layers, or a Hugging Face mixture of experts "
            f"with an expert-parallel plan (split at initialize). Use expert size 1")


def _check_pipeline(model: torch.nn.Module, cfg: ResolvedConfig, parallel: ParallelGroups) -> None:
    if not isinstance(model, PipelineModule):
        raise ConfigError(f"config key 'zeroplus.parallel.pipeline' is {parallel.topology.pipeline}, and the model is "
                          f"a {type(model).__name__}: give a zeroplus.parallel.PipelineModule (its stage's layers)")
    zp = cfg.zeroplus
    if zp.resize_recompute.enabled or zp.swap_attention.enabled:
        raise ConfigError("config keys 'zeroplus.resize_recompute' / 'zeroplus.swap_attention' with pipeline "
                          "parallelism: not supported yet (1F1B keeps several micro-batches' activations at once)")


def _device_bytes(model: torch.nn.Module, accel: Accelerator) -> int:
    """Bytes of the model's parameters and buffers on the device (each storage once)."""
    device = accel.device()
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers()) if t.device.type == device.type}
    return sum(storages.values())


def _warn_mixed_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A model whose floating parameters come in more than one dtype (a unit mixing fp32 and bf16: a module kept
    in fp32 by the model's code, or cast by hand) is computed in the one compute dtype, as DeepSpeed's engine casts
    it: what it held in another dtype is named, since its forward then computes those in ``dtype``."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and not packed_storage(p):  # (packed quantized weights keep their storage)
            by_dtype.setdefault(p.dtype, []).append(name)
    if len(by_dtype) > 1:
        other = {str(d).split(".")[-1]: names[:4] + (["..."] if len(names) > 4 else [])
                 for d, names in by_dtype.items() if d != dtype}
        log_rank0("the model's parameters come in %d dtypes; each is cast to the compute dtype %s (the forward "
                  "computes them in it): %s", len(by_dtype), str(dtype).split(".")[-1], other, level=logging.WARNING)


def _warn_flat_mics_gathers(cfg: ResolvedConfig, parallel: ParallelGroups | None) -> None:
    """``zero_optimization.mics_hierarchical_params_gather`` gathers a MiCS shard group that spans nodes in two levels
    (``zero/two_level_gather.py``); within one node there is nothing to change, and without ``mics_shard_size`` it does
    nothing, as in DeepSpeed (said once). Where the shard groups do not split into whole nodes, the gathers run in one
    level (the same values): said once."""
    zero = cfg.zero_optimization
    if not zero.mics_hierarchical_params_gather:
        return
    if zero.mics_shard_size == -1:
        log_rank0("zero_optimization.mics_hierarchical_params_gather is set without mics_shard_size: it does "
                  "nothing, as in DeepSpeed", level=logging.WARNING)
        return
    if parallel is None:  # (an engine built without parallel groups: no shard groups to lay over nodes)
        return
    topology, node = parallel.topology, node_ranks(cfg)
    part = topology.shard or topology.data * topology.context
    if node == 1 or (node and part <= node):  # (a node's one rank of the group: the one level is the two)
        return
    if topology.node:
        log_rank0("zero_optimization.mics_hierarchical_params_gather: the MiCS shard groups of %d ranks gather in two "
                  "levels, across the %d nodes of %d ranks and then within each", part, part // node, node)
    else:
        log_rank0("zero_optimization.mics_hierarchical_params_gather: the MiCS shard groups of %d ranks do not split "
                  "into whole nodes (%d ranks a node, tensor size %d), and zeroplus gathers them in one level (the "
                  "same values)", part, ranks_per_node(cfg), topology.tensor, level=logging.WARNING)


def _warn_inert_options(cfg: ResolvedConfig) -> None:
    """Say once which accepted options have no effect yet."""
    zero = cfg.zero_optimization
    inert = []
    defaults = type(zero)()
    keys = ["allgather_bucket_size"]
    if not zero.offloads_optimizer:
        keys.append("sub_group_size")
    if zero.stage.shards_parameters:
        keys += ["stage3_max_live_parameters", "stage3_max_reuse_distance"]
    inert += [f"zero_optimization.{key}" for key in keys if getattr(zero, key) != getattr(defaults, key)]
    if cfg.zeroplus.quantized_gradient_bits != 8 and not zero.zero_quantized_gradients:
        inert.append("zeroplus.quantized_gradient_bits (qgZ's code width; zero_optimization.zero_quantized_gradients "
                     "is off)")
    if cfg.zeroplus.quantized_weights_dtype != "int8" and not zero.zero_quantized_weights:
        inert.append("zeroplus.quantized_weights_dtype (qwZ's codes; zero_optimization.zero_quantized_weights is off)")
    if zero.offload_param is not None:  # zeroplus reads whole shards of one unit ahead, no buffer pool
        param_defaults = type(zero.offload_param)()
        inert += [f"zero_optimization.offload_param.{key}" for key in ("buffer_size", "max_in_cpu")
                  if getattr(zero.offload_param, key) != getattr(param_defaults, key)]
    if inert:
        log_rank0("accepted but without effect yet: %s", "; ".join(inert), level=logging.WARNING)


def _split_sequences(model: torch.nn.Module, parallel: ParallelGroups) -> None:
    """Context parallelism: zeroplus's GPT splits its sequences itself; a Hugging Face causal LM gets
    Ulysses or ring attention and a forward that keeps this rank's part (``models/context_hf.py``)."""
    if getattr(model, "splits_own_sequences", False):  # zeroplus's GPT (a capability, not its class)
        return
    if not is_hf_causal_lm(model):
        raise ConfigError(f"config key 'zeroplus.parallel.context' ({parallel.topology.context}): "
                          f"{type(model).__name__} is neither zeroplus's GPT nor a Hugging Face causal LM; split its "
                          f"sequences with zeroplus.parallel.context (local_slice, positions, seq_to_heads and "
                          f"heads_to_seq around attention)")
    try:
        context_parallel_hf(model, parallel.context, parallel.context_mode,
                            (parallel.context_ulysses, parallel.context_ring))
    except ValueError as err:
        raise ConfigError(f"config key 'zeroplus.parallel.context': {err}") from None
