"""ZeRO partitioning of a model over a data-parallel group: one code path for stages 0-3.

The partition owns the units and their flat groups (``units.py``, ``flat_group.py``), hooks
every trainable parameter's gradient accumulation (at one rank only where a use is routed: the groups that keep
autograd's gradients take them when the backward ends), reduces gradients (``grad_reducer.py``) and,
at stage 3, gathers and releases parameters (``stage3.py``).

When gradients are reduced, group by group as a backward delivers them: ``grad_schedule.py``.

Experts (``zeroplus.parallel.MoE``, expert-parallel size E > 1): a unit's expert parameters form
flat groups of their own, partitioned over the expert-data group (the D / E ranks holding the same
experts) instead of the data group; memory per rank for them is the table of ``flat_group.py`` with
N = D / E. Their names carry ``@epE`` (the expert rank) so checkpoints tell the expert ranks apart.
Their gradients are summed over the expert-data group and divided by D like every other gradient:
each expert's local gradient already sums the tokens of its E expert-parallel ranks.

After the optimizer step, the new master values are written into the compute-dtype parameters;
stages 1 and 2 all-gather them asynchronously, root unit first, and the next forward waits for
each unit's gather just before that unit runs.
See note: post-step gathers; see note: expert groups; see note: early per-use reduction;
see note: root per-use groups; see note: one-rank hooks (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import torch

from ..activations.choices import TechniqueChoice
from ..activations.grad_rows import RowsSink, offer_rows
from ..collectives import Collectives
from ..config import ResolvedZeroConfig, ZeroStage
from ..eager import eager
from ..ledger import Ledger
from ..offload.policies import MasterPolicy
from .buffer_pool import BufferPool
from .flat_group import FLAT_ATTR, FlatParamGroup, Joined, wait_all
from .grad_reducer import GradReducer
from .grad_schedule import BackwardSchedule
from .param_status import ParamStatus, label_whole, mark
from .placement import UnitPlacement
from .quantized import packed_storage, prepare_packed
from .stage3 import ResidentScheduler, Stage3Scheduler
from .stage3_state_dict import install_state_dict_hooks
from .two_level_gather import TwoLevelGather
from .units import Named, Unit, assign_parameters, bucketed, find_unit_modules, frozen_dtype, issue_joined
from .use_grads import UseGrads, UseSinks, routed, rows_into_grad, tied

logger = logging.getLogger("zeroplus.zero")


@dataclasses.dataclass
class ExpertSplit:
    """Where expert parameters are partitioned: ``group`` (expert-data), this rank's ``expert_rank`` of
    ``expert_size``; ``holds(param)`` tells an expert's parameter."""

    group: Collectives
    expert_rank: int
    expert_size: int
    holds: Callable[[torch.Tensor], bool]
    tensor_span: int = 1  # the expert-data mode: the tensor size the expert groups are drawn across, else 1

    @property
    def suffix(self) -> str:
        return f"@ep{self.expert_rank}"

    def data_ranks(self) -> list[int]:
        """The data-parallel ranks of this expert-data group, in its rank order (d = e + E * x; the expert-data
        mode: ``t + T d = e + E x``, and with E a multiple of T every member has tensor rank ``e mod T``)."""
        return [(self.expert_rank + self.expert_size * x) // self.tensor_span for x in range(self.group.size)]

def _nothing() -> None:
    """``UseSinks.made`` of a parameter whose dense uses are not routed: nothing to count."""


def _refuse_partitioned(model: torch.nn.Module, rank: int) -> None:
    """A model another engine still partitions (not destroyed) is refused: two engines' hooks on one model
    would both count its gradients, and a stage-3 engine dropped without ``destroy()`` left its parameters
    empty (their values were on its shards)."""
    for name, p in model.named_parameters():
        group = getattr(p, FLAT_ATTR, None)
        if group is not None:
            state = ("its engine is gone without destroy(), which gathers the values back (dropped, or its "
                     "initialize failed): the released parameters hold no values" if group.owner.hooks_dropped
                     else "is still partitioned by it")
            raise ValueError(f"zeroplus.initialize on rank {rank}: parameter {name!r} belongs to another engine's "
                             f"flat group {group.name} and {state}; call engine.destroy() on the first engine "
                             f"(every rank) before initializing the same model again")


@dataclasses.dataclass(frozen=True)
class _GroupMaker:
    """How a partition makes one unit's flat groups: its trained parameters by (param group, expert, per-use) and
    its frozen ones by dtype, each run cut at ``bucket`` elements (``bucketed``)."""

    stage: ZeroStage
    dp: Collectives
    ledger: Ledger
    master: MasterPolicy
    device: torch.device | None
    bucket: int
    compute_dtype: torch.dtype
    secondary: Collectives | None = None  # hpZ's group (stage 3), for every group partitioned over ``dp``
    levels: TwoLevelGather | None = None  # MiCS's hierarchical gather over ``dp``, for every group partitioned over it

    def trained(self, name: str, by_group: dict[tuple[int, bool, bool], list[tuple[str, torch.nn.Parameter]]],
                experts: ExpertSplit | None) -> list[FlatParamGroup]:
        groups = []
        for gi, expert, apart in sorted(by_group):
            runs = bucketed(by_group[(gi, expert, apart)], self.bucket)
            for k, named in enumerate(runs):
                label = f"{name}#{gi}" + ("-uses" if apart else "") + (f".{k}" if len(runs) > 1 else "")
                group_dp = self.dp
                split = experts if expert else None
                if split is not None:
                    named = [(f"{n}{split.suffix}", p) for n, p in named]
                    group_dp, label = split.group, label + split.suffix
                groups.append(FlatParamGroup(label, named, gi, self.stage, group_dp, self.compute_dtype, self.ledger,
                                             self.master, self.device,
                                             expert_ranks=None if split is None else split.data_ranks(),
                                             secondary=self.secondary if split is None else None,
                                             levels=self.levels if split is None else None))
        return groups

    def frozen(self, name: str, by_dtype: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]]
               ) -> list[FlatParamGroup]:
        frozen = []
        for dtype, named_of_dtype in by_dtype.items():  # (the compute dtype; packed quantized storage)
            runs = bucketed(named_of_dtype, self.bucket)
            label = f"{name}#frozen" + ("" if dtype == self.compute_dtype else f"-{str(dtype).split('.')[-1]}")
            frozen += [FlatParamGroup(label + (f".{k}" if len(runs) > 1 else ""), named, -1, self.stage, self.dp,
                                      dtype, self.ledger, self.master, self.device, trainable=False,
                                      secondary=self.secondary, levels=self.levels)
                       for k, named in enumerate(runs)]
        return frozen


class ZeroPartition:
    def __init__(self, model: torch.nn.Module, zero: ResolvedZeroConfig, dp: Collectives, ledger: Ledger,
                 compute_dtype: torch.dtype, param_group_of: dict[int, int],
                 unit_class_names: list[str] | None = None, gradient_accumulation_steps: int = 1,
                 master: MasterPolicy = MasterPolicy(), experts: ExpertSplit | None = None,
                 placement: UnitPlacement | None = None, defer_param_gather: bool = False,
                 secondary: Collectives | None = None, nodes: tuple[Collectives, Collectives] | None = None,
                 gradient_bits: int = 8, weights_dtype: str = "int8", replicas: int = 1,
                 rows: TechniqueChoice | None = None) -> None:
        """``master``: how flat groups keep their fp32 master shards; ``experts``: the expert-data group and
        expert rank when experts are split over ranks, else None. ``placement``: moves each unit's other
        tensors to the device just before its flat groups are built (``placement.py``: one unit at a
        time); None leaves every tensor where it is. At stages 2-3, per-use groups are reduced
        early and embeddings' rows sparsely (``early_per_use``). ``defer_param_gather``
        (``zeroplus.overlap_param_gather``): stages 1-2's post-step all-gathers are waited by each unit's next
        forward instead of before ``after_step`` returns. ``secondary``: hpZ's group at stage 3 (``flat_group.py``;
        see note: hpz), or None. ``nodes``: ``dp``'s nodes (this rank's node, the ranks at its place in each), for qgZ's
        two levels (``grad_reducer.py``) and, where ``zero.mics_hierarchical_params_gather`` asks, the parameters'
        gathers (``two_level_gather.py``); None: one level. ``gradient_bits``: qgZ's code width
        (``zeroplus.quantized_gradient_bits``); ``weights_dtype``: qwZ's codes
        (``zeroplus.quantized_weights_dtype``); ``replicas``: under MiCS, how many shard groups ``dp`` is one of
        (``grad_reducer.py``). ``rows``: whether embeddings send their gradients as rows (``use_grads.py``), read at
        each forward; None: always."""
        _refuse_partitioned(model, dp.rank)
        self.defer_param_gather = defer_param_gather
        self.stage = ZeroStage(zero.stage)
        self.dp = dp
        self.ledger = ledger
        frozen_too = self.stage.shards_parameters  # frozen parameters are partitioned too (see note: frozen groups)
        unit_modules = find_unit_modules(model, unit_class_names, frozen_too)
        self.units: list[Unit] = []
        device = placement.device if placement is not None else None
        assigned = assign_parameters(model, unit_modules, frozen_too)
        per_use, alone = self._per_use(model, assigned, param_group_of)
        # (the key gathers MiCS's shard groups in two levels; without mics_shard_size it does nothing, as in DeepSpeed,
        # though qgZ's nodes exist)
        hierarchical = zero.mics_hierarchical_params_gather and zero.mics_shard_size != -1
        levels = TwoLevelGather(*nodes, ledger) if nodes is not None and hierarchical else None
        maker = _GroupMaker(self.stage, dp, ledger, master, device, zero.reduce_bucket_size, compute_dtype,
                            secondary if self.stage.shards_parameters else None, levels)
        for index, (name, module, params) in enumerate(assigned):
            if placement is not None:
                placement.prepare(module, [m for _, m in unit_modules])
            by_group: dict[tuple[int, bool, bool], list[tuple[str, torch.nn.Parameter]]] = {}
            frozen_named: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]] = {}  # by the group's dtype
            for pname, p in params:
                if p.requires_grad and id(p) in param_group_of:
                    expert = experts is not None and experts.holds(p)
                    by_group.setdefault((param_group_of[id(p)], expert, id(p) in alone), []).append((pname, p))
                elif (dtype := frozen_dtype(p, self.stage, experts, compute_dtype)) is not None:
                    if packed_storage(p):
                        prepare_packed(pname, p, module, device, dp.rank)
                    frozen_named.setdefault(dtype, []).append((pname, p))
            groups, frozen = maker.trained(name, by_group, experts), maker.frozen(name, frozen_named)
            unit = Unit(index=index, name=name, module=module, groups=groups, is_root=(module is model),
                        frozen=frozen)
            if self.stage.shards_parameters and unit.numel <= zero.stage3_param_persistence_threshold:
                unit.keep_gathered()
            self.units.append(unit)
        self.root = self.units[-1]
        self._adopt_units(model)
        overlap = True if zero.overlap_comm is None else zero.overlap_comm
        # stages 2-3 add each micro-batch's reduced gradient into the shard: in fp32, or in the compute dtype under bf16
        # masters (DeepSpeed's bf16_master_weights_and_grads: gradients kept in bf16, 2 bytes an element, not 4)
        accumulate_fp32 = (self.stage.shards_gradients and gradient_accumulation_steps > 1
                           and master.bf16_rounding is None)
        # (qgZ at stage 3 reduce-scatters whatever reduce_scatter says: engine/build.py's _check_quantized)
        reduce_scatter = zero.reduce_scatter or (zero.zero_quantized_gradients and self.stage.shards_parameters)
        reducer = GradReducer(self.stage, dp, zero.reduce_bucket_size, reduce_scatter, overlap, ledger,
                              accumulate_fp32, zero.zero_quantized_gradients, nodes, gradient_bits, replicas)
        self.stage3: Stage3Scheduler | None = None  # (stage 3: made as the model is hooked, after the per-use swaps)
        self.backward = BackwardSchedule(self.stage, dp, self.units, reducer, self.pool, rows)
        self._hooks: list[Any] = []
        self.hooks_dropped = False  # drop_hooks()
        per_use -= self._embeddings_kept_whole(model)
        self._install_hooks(model, per_use, zero.stage3_prefetch_bucket_size,
                            weights_dtype if zero.zero_quantized_weights else None, rows)

    def _adopt_units(self, model: torch.nn.Module) -> None:
        """The units' groups attached to this partition and its buffer pool, listed, and the parameters' status set."""
        # stage 3: freed gathered units reused within a pass (CPU buffers); a parked buffer's request may be two
        # units' gathers ahead
        self.pool = BufferPool(self.ledger, lookahead=2 * max(len(u.all_groups) for u in self.units))
        # nothing gathered or released (stages 0-2; stage 3 at one rank in fp32, every group resident): never opened
        self.pool.enabled &= self.stage.shards_parameters and not all(
            g.resident for u in self.units for g in u.all_groups)
        for u in self.units:
            for g in u.all_groups:
                g.attach(u, self, self.pool)
        self.groups: list[FlatParamGroup] = [g for u in self.units for g in u.groups]
        self.frozen: list[FlatParamGroup] = [g for u in self.units for g in u.frozen]  # stage 3 (units.py)
        # hpZ: the groups that can hold a secondary copy (``drop_secondaries`` has nothing to do for the others)
        self._with_secondary = [g for g in self.groups + self.frozen if g.secondary_group is not None]
        flat = {id(p) for g in self.groups + self.frozen for p in g.params}
        mark([p for p in model.parameters() if id(p) not in flat], ParamStatus.AVAILABLE)  # never partitioned
        if self.stage.shards_parameters:  # what Transformers and PEFT read of a released parameter (param_status.py)
            label_whole([(p, s) for g in self.groups + self.frozen for p, s in zip(g.params, g.shapes)])

    def _install_hooks(self, model: torch.nn.Module, per_use: set[int], prefetch: int | None,
                       quantize: str | None = None, rows: TechniqueChoice | None = None) -> None:
        """Every hook this partition puts on the model (``drop_hooks`` removes them all): each trained parameter's
        gradient hook and row sink, the per-use routing (``use_grads.py``), stages 1-2's waits for the post-step
        all-gathers, stage 3's scheduler and state-dict hooks."""
        sinks: dict[int, UseSinks] = {}
        self._row_sinks: list[RowsSink] = []  # the registry holds them weakly (grad_rows.py): alive with the partition
        # one rank: a tied weight of a group without hooks sends only its embedding's rows, into its .grad
        into_grad = {id(p) for g in self.groups if self._hookless(g) for p in g.params if id(p) in per_use}
        per_use = per_use - into_grad
        # one rank: groups that keep autograd's gradients and route no use take them when the backward ends
        self.backward.taken_at_end = [g for g in self.groups if self._takes_at_end(g, per_use)]
        at_end = {id(p) for g in self.backward.taken_at_end for p in g.params}
        for g in self.groups:
            for i, p in enumerate(g.params):
                hooked = id(p) not in at_end  # (taken at the end: a gradient made whole is the one kept, no rows)
                if hooked:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(g, i)))
                if hooked and len(g.shapes[i]) == 2:  # slices straight into the flat buffer; the hook (run after,
                    # no gradient) counts. (The recorded shape: a released stage-3 parameter is empty.)
                    self._row_sinks.append(functools.partial(g.gradient.add_slice, i))
                    offer_rows(p, self._row_sinks[-1])
                if id(p) in per_use:
                    sinks[id(p)] = UseSinks(functools.partial(self.backward.dense_use_arrived, g, i),
                                            functools.partial(self.backward.rows_arrived, g, i),
                                            functools.partial(self.backward.dense_use_made, g))
                elif id(p) in into_grad:
                    sinks[id(p)] = UseSinks(None, rows_into_grad(p), _nothing)
        self.use_grads = UseGrads(model, sinks, on_replay=self.backward.holder_replayed, rows=rows)
        for g in self.groups:
            for i, p in enumerate(g.params):
                if id(p) in per_use:
                    g.gradient.arrival.route_per_use(i, by_rows=id(p) in self.use_grads.row_receivers)
        if self.stage.gathers_after_step:  # every unit, the root included, waits for its post-step all-gather before
            for unit in self.units if self.dp.size > 1 else []:  # its forward (one rank: nothing to wait for)
                self._hooks.append(unit.module.register_forward_pre_hook(eager(self._make_wait_hook(unit))))
            # and any state_dict() for all of them, even called on the model
            self._hooks.append(model.register_state_dict_pre_hook(lambda *args: self.wait_all()))
        # after each step, root first: each unit's groups whose gather completes at once (a data-parallel group of
        # one rank: no forward hook waits there) and those whose gathers are joined (``_push_masters``)
        self._push_order = [([g for g in groups if g.dp.size == 1], [g for g in groups if g.dp.size > 1])
                            for groups in [self.root.groups] + [u.groups for u in self.units[:-1]]]
        resident = all(g.resident for g in self.groups + self.frozen)  # one rank in fp32: nothing moves
        if self.stage.shards_parameters:
            scheduler = ResidentScheduler if resident else Stage3Scheduler  # (nothing moves: nothing scheduled)
            self.stage3 = scheduler(self.units[:-1], self.root, prefetch, self.pool, quantize=quantize)
            self.backward.stage3 = self.stage3
            self._hooks += install_state_dict_hooks(model, self.units)

    # -- forward ------------------------------------------------------------------------------
    def before_forward(self) -> None:
        # Stages 1-2: each unit (the root first) waits for its own post-step all-gather in a forward
        # pre-hook, so later blocks' gathers overlap earlier compute.
        if not self.stage.gathers_after_step:
            self.wait_all()
        if self.stage3 is not None:
            self.stage3.begin_forward()

    def _make_wait_hook(self, unit: Unit):
        def hook(module: torch.nn.Module, args: object) -> None:
            wait_all(unit.groups)
        return hook

    def after_forward(self) -> None:
        if self.stage3 is not None:
            self.stage3.end_forward()
            if torch.is_grad_enabled() and self.backward.root_trusted() and not self.root.persistent:
                for g in self.root.groups:
                    if self._rows_only(g):
                        g.release()

    @staticmethod
    def _rows_only(group: FlatParamGroup) -> bool:
        """A root group of plain embeddings' weights only (each a per-use parameter whose gradient comes by
        rows) that no dense holder used in this forward: after the forward nothing reads its values (an
        embedding's backward runs on its detached weight's rows, ``use_grads.py``), so its gathered buffer is
        freed at the forward's end rather than held through backward (see note: embeddings released). Not in a
        persistent root (under ``stage3_param_persistence_threshold``): its post-step gather refills the buffer."""
        every = set(range(len(group.params)))
        arrival = group.gradient.arrival
        return arrival.per_use == every and arrival.row_params == every and arrival.dense_uses_back()

    # -- backward: when gradients are reduced (grad_schedule.py) --------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """``reduce``: reduce gradients in this backward (always at stages 2-3, at the boundary at 0-1)."""
        self.backward.begin(reduce)

    def end_backward(self) -> None:
        self.backward.end()
        if self.backward.at_boundary:  # hpZ: the step changes the values; its peak holds no secondary copy
            self.drop_secondaries()

    @property
    def early_per_use(self) -> bool:
        return self.backward.early_per_use

    # -- per-use gradients (use_grads.py) -----------------------------------------------------------
    def _per_use(self, model: torch.nn.Module, assigned: list[tuple[str, torch.nn.Module, Named]],
                 param_group_of: dict[int, int]) -> tuple[set[int], set[int]]:
        """(the parameters taking the per-use path, ``use_grads.routed``; those of them in flat groups of their
        own). At stages 2-3 the root unit's per-use parameters (its embeddings, a tied head's weight) are apart:
        an untied embedding's gradient comes only as rows, reduced sparsely, so its group never allocates a flat
        gradient; in one group with the head and final norm it would be allocated whole (vocabulary x hidden in
        the compute dtype, e.g. 1 GiB for a 128k-token bf16 embedding at hidden 4096) when the head's gradient
        arrives, and its zeros reduced with them."""
        trained = [{id(p) for _, p in params if p.requires_grad and id(p) in param_group_of}
                   for _, _, params in assigned]
        root = trained[-1]
        per_use = routed(model, set().union(*trained), root)
        return per_use, (per_use & root if self.stage.shards_gradients else set())

    def _embeddings_kept_whole(self, model: torch.nn.Module) -> set[int]:
        """One rank (see note: one-rank hooks): the untied parameters of groups that keep autograd's gradients, taken
        off the per-use path. An untied embedding's dense gradient is then the kept one, no larger than its share of
        a flat buffer: rows would buy no memory and cost that buffer, a copy of the group's other gradients and a
        sort of the tokens. (A tied weight keeps the path: it spares a table-sized gradient, note 42.)"""
        shared = tied(model)
        return {id(p) for g in self.groups if g.gradient.keeps for p in g.params if id(p) not in shared}

    def _hookless(self, group: FlatParamGroup) -> bool:
        """One rank (see note: one-rank hooks): ``group`` keeps autograd's gradients and, at stage 3, stays gathered,
        so nothing is reduced or released when one of its gradients arrives."""
        return group.gradient.keeps and (group.resident or not self.stage.shards_parameters)

    def _takes_at_end(self, group: FlatParamGroup, per_use: set[int]) -> bool:
        """``_hookless`` and none of ``group``'s parameters routes its uses: its gradients are taken from ``.grad``
        when the backward ends (``BackwardSchedule._take_at_end``), not by a hook each."""
        return self._hookless(group) and not any(id(p) in per_use for p in group.params)

    def _make_grad_hook(self, group: FlatParamGroup, index: int):
        def hook(param: torch.nn.Parameter) -> None:
            self.backward.arrived(group, index, param)
        return hook

    # -- after the optimizer step ------------------------------------------------------------
    def _push_masters(self) -> None:
        """Write every master into its low-precision parameters (stages 1-2 also start the all-gathers), root
        first: the next forward needs the embeddings before any block. The gathers are joined (see note: joined
        gathers): each unit's as one collective where the forward waits for them unit by unit
        (``defer_param_gather``), else every group's as one, which ``after_step`` waits for at once."""
        joined: Joined = {}
        for alone, shared in self._push_order:
            for g in alone:
                if g.master_to_params():
                    g.gather_shard().wait()
            for g in shared:
                if g.master_to_params() and not g.join_gather(joined):
                    g.gathers.append(g.gather_shard())
            if self.defer_param_gather:
                issue_joined(joined)
        issue_joined(joined)

    def drop_secondaries(self) -> None:
        """hpZ: every group's secondary copy goes (the values are about to change, or changed)."""
        for g in self._with_secondary:
            g.drop_secondary()

    def after_step(self) -> None:
        self.drop_secondaries()
        self._push_masters()
        if not self.defer_param_gather:  # every parameter of the model object current when step() returns
            self.wait_all()
        for g in self.groups:
            g.free_grads()
        if self.stage3 is not None:
            self.stage3.refresh_persistent()
            self.stage3.prefetch_for_next_forward()

    def params_from_masters(self) -> None:
        """After the masters were overwritten (a checkpoint load): make every low-precision copy
        follow them. Stage 3 drops whatever is gathered (it is stale) and re-gathers persistent
        units; stages 0-2 copy and all-gather as after a step."""
        self.wait_all()
        self.drop_secondaries()
        if self.stage3 is not None:
            for unit in self.units:
                unit.release(force=True)
            for unit in self.units:
                if unit.persistent:
                    unit.wait_gather()
            return
        self._push_masters()
        self.wait_all()  # (a load is no place to overlap: the model object reads current values after it)

    def wait_all(self) -> None:
        wait_all(self.groups)

    def remove(self) -> None:
        """Give the model back (``Engine.destroy``): every collective waited for; at stage 3 every unit gathered
        and left so, its parameters holding their current values (in the compute dtype, as at stages 0-2: a
        collective, and one model's worth of memory, as before ``initialize``); every hook this partition put on
        the model removed (gradient, forward, state-dict; stage 3's gather and release; the per-use swaps)."""
        self.wait_in_flight()
        if self.stage3 is not None:
            for unit in self.units:
                unit.wait_gather()
        self.drop_hooks()
        for g in self.groups + self.frozen:
            g.forget_params()

    def drop_hooks(self) -> None:
        """Remove every hook this partition put on the model, and nothing else: no collective (``Engine``'s
        finalizer calls it alone when an engine is garbage-collected without ``destroy()``, on each rank at a
        moment of its own). At stages 0-2 the parameters then keep their values, views of the flat buffers
        they keep alive, and are plain parameters again; at stage 3 the released ones stay empty and keep
        their group, so a later ``initialize`` refuses them (``ZeroPartition`` below) instead of training on
        no values."""
        self.hooks_dropped = True
        self.backward.taken_at_end = []
        if self.stage3 is not None:
            self.stage3.remove()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.use_grads.remove()
        if not self.stage.shards_parameters:
            for g in self.groups + self.frozen:
                g.forget_params()

    def wait_in_flight(self) -> None:
        """Every collective this partition issued and nobody waited for yet: reductions, post-step
        all-gathers, and stage 3's prefetched gathers (before the process group goes away)."""
        self.wait_all()
        for unit in self.units:
            unit.wait_handles()

    def consolidated_fp32_state(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter's full fp32 master value by qualified name (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for g in self.groups:
            flat = g.gather_master()
            for name, off, n, shape in zip(g.names, g.offsets, g.numels, g.shapes):
                out[name] = flat[off:off + n].view(shape).clone()
        return out

    def describe(self) -> str:
        lines = [f"ZeRO stage {self.stage}, data-parallel size {self.dp.size}, {len(self.units)} units, "
                 f"{len(self.groups)} flat groups"
                 + (f" and {len(self.frozen)} frozen (shards only: no gradient, master or optimizer state)"
                    if self.frozen else "")]
        for u in self.units:
            lines.append(f"  unit {u.name}: {u.numel} elements in {len(u.groups)} group(s)"
                         + (f" and {len(u.frozen)} frozen" if u.frozen else "")
                         + (" (persistent)" if u.persistent else ""))
        return "\n".join(lines)
