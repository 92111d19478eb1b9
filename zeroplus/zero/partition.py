"""ZeRO partitioning of a model over a data-parallel group: one code path for stages 0-3.

The partition owns the units and their flat groups (``units.py``, ``flat_group.py``), hooks
every trainable parameter's gradient accumulation (at one rank only where a use is routed: the groups that keep
autograd's gradients take them when the backward ends), reduces gradients (``grad_reducer.py``) and,
at stage 3, gathers and releases parameters (``stage3.py``).

When gradients are reduced: stages 0 and 1 at the accumulation boundary only (gradients
accumulate in the flat compute-dtype buffer between micro-batches); stages 2 and 3 after every
micro-batch, into the fp32 gradient shard, freeing the flat buffer. Each flat group's reduction
starts as soon as its last gradient has arrived, so communication overlaps the rest of the
backward; the handles are waited on when the backward is over, or earlier once more than
``MAX_GROUPS_IN_FLIGHT`` groups are in flight. A tied parameter's uses, and the root unit's
embeddings, add their gradients into the flat buffer as they are computed (``use_grads.py``). At
stages 2-3 such a group is reduced as soon as its dense gradients are in (the tied head's, at the
start of backward), so its flat buffer does not live through the backward; the embedding's rows
are kept as per-token sums and reduced sparsely into the shard when the backward ends
(``row_reduce.py``). At stages 0-1 the rows go into the flat buffer. At stages 2-3 the root unit's
per-use parameters form groups of their own (label ``-uses``): an untied embedding's group then never
allocates a flat gradient (vocabulary x hidden in the compute dtype saved for the whole backward).

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

import collections
import dataclasses
import functools
import logging
from typing import Any, Callable

import torch

from ..activations.grad_rows import RowsSink, offer_rows
from ..collectives import Collectives
from ..config import ResolvedZeroConfig, ZeroStage
from ..eager import eager
from ..ledger import Ledger
from ..offload.policies import MasterPolicy
from .buffer_pool import BufferPool
from .flat_group import FLAT_ATTR, FlatParamGroup
from .grad_reducer import GradReducer
from .kept_grads import keep_all_at_once
from .param_status import ParamStatus, label_whole, mark
from .placement import UnitPlacement
from .quantized import packed_storage, prepare_packed
from .row_reduce import reduce_rows
from .stage3 import Stage3Scheduler
from .stage3_state_dict import install_state_dict_hooks
from .units import Named, Unit, assign_parameters, bucketed, find_unit_modules, frozen_dtype
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

# Reductions still in flight when the next one starts; older ones are waited on, which bounds
# the flat gradients and comm buffers alive during backward to about this many groups.
MAX_GROUPS_IN_FLIGHT = 1  # see note: one reduction in flight


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


class ZeroPartition:
    def __init__(self, model: torch.nn.Module, zero: ResolvedZeroConfig, dp: Collectives, ledger: Ledger,
                 compute_dtype: torch.dtype, param_group_of: dict[int, int],
                 unit_class_names: list[str] | None = None, gradient_accumulation_steps: int = 1,
                 master: MasterPolicy = MasterPolicy(), experts: ExpertSplit | None = None,
                 placement: UnitPlacement | None = None, defer_param_gather: bool = False) -> None:
        """``master``: how flat groups keep their fp32 master shards; ``experts``: the expert-data group and
        expert rank when experts are split over ranks, else None. ``placement``: moves each unit's other
        tensors to the device just before its flat groups are built (``placement.py``: one unit at a
        time); None leaves every tensor where it is. At stages 2-3, per-use groups are reduced
        early and embeddings' rows sparsely (``early_per_use``). ``defer_param_gather``
        (``zeroplus.overlap_param_gather``): stages 1-2's post-step all-gathers are waited by each unit's next
        forward instead of before ``after_step`` returns."""
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
        for index, (name, module, params) in enumerate(assigned):
            if placement is not None:
                placement.prepare(module, [m for _, m in unit_modules])
            groups = []
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
            for gi, expert, apart in sorted(by_group):
                runs = bucketed(by_group[(gi, expert, apart)], zero.reduce_bucket_size)
                for k, named in enumerate(runs):
                    label = f"{name}#{gi}" + ("-uses" if apart else "") + (f".{k}" if len(runs) > 1 else "")
                    group_dp = dp
                    split = experts if expert else None
                    if split is not None:
                        named = [(f"{n}{split.suffix}", p) for n, p in named]
                        group_dp, label = split.group, label + split.suffix
                    groups.append(FlatParamGroup(label, named, gi, self.stage, group_dp, compute_dtype, ledger,
                                                 master, device,
                                                 expert_ranks=None if split is None else split.data_ranks()))
            frozen = []
            for dtype, named_of_dtype in frozen_named.items():  # (the compute dtype; packed quantized storage)
                runs = bucketed(named_of_dtype, zero.reduce_bucket_size)
                label = f"{name}#frozen" + ("" if dtype == compute_dtype else f"-{str(dtype).split('.')[-1]}")
                frozen += [FlatParamGroup(label + (f".{k}" if len(runs) > 1 else ""), named, -1, self.stage, dp,
                                          dtype, ledger, master, device, trainable=False)
                           for k, named in enumerate(runs)]
            unit = Unit(index=index, name=name, module=module, groups=groups, is_root=(module is model),
                        frozen=frozen)
            if self.stage.shards_parameters and unit.numel <= zero.stage3_param_persistence_threshold:
                unit.keep_gathered()
            self.units.append(unit)
        self.root = self.units[-1]
        # stage 3: freed gathered units reused within a pass (CPU buffers); a parked buffer's request may be two
        # units' gathers ahead
        self.pool = BufferPool(ledger, lookahead=2 * max(len(u.all_groups) for u in self.units))
        for u in self.units:
            for g in u.all_groups:
                g.attach(u, self, self.pool)
        self.groups: list[FlatParamGroup] = [g for u in self.units for g in u.groups]
        self._all_keep = bool(self.groups) and all(g.keeps_grads for g in self.groups)  # one rank (early_per_use)
        self.frozen: list[FlatParamGroup] = [g for u in self.units for g in u.frozen]  # stage 3 (units.py)
        flat = {id(p) for g in self.groups + self.frozen for p in g.params}
        mark([p for p in model.parameters() if id(p) not in flat], ParamStatus.AVAILABLE)  # never partitioned
        if self.stage.shards_parameters:  # what Transformers and PEFT read of a released parameter (param_status.py)
            label_whole([(p, s) for g in self.groups + self.frozen for p, s in zip(g.params, g.shapes)])
        overlap = True if zero.overlap_comm is None else zero.overlap_comm
        accumulate_fp32 = self.stage.shards_gradients and gradient_accumulation_steps > 1
        self.reducer = GradReducer(self.stage, dp, zero.reduce_bucket_size, zero.reduce_scatter, overlap, ledger,
                                   accumulate_fp32)
        self._in_flight: collections.deque[FlatParamGroup] = collections.deque()
        self.at_boundary = True  # this backward ends an accumulation (begin_backward)
        self._ready: set[int] = set()
        self._unit_of_group = {id(g): u for u in self.units for g in u.groups}
        self._deferred: list[FlatParamGroup] = []  # per-use groups whose dense use just arrived (_dense_use_arrived)
        self.release_root_early = True  # cleared for good by a use outside the holders or a replay
        self._backwards_seen = 0
        self._hooks: list[Any] = []
        self.hooks_dropped = False  # drop_hooks()
        per_use -= self._embeddings_kept_whole(model)
        self._install_hooks(model, per_use, zero.stage3_prefetch_bucket_size)

    def _install_hooks(self, model: torch.nn.Module, per_use: set[int], prefetch: int | None) -> None:
        """Every hook this partition puts on the model (``drop_hooks`` removes them all): each trained parameter's
        gradient hook and row sink, the per-use routing (``use_grads.py``), stages 1-2's waits for the post-step
        all-gathers, stage 3's scheduler and state-dict hooks."""
        sinks: dict[int, UseSinks] = {}
        self._row_sinks: list[RowsSink] = []  # the registry holds them weakly (grad_rows.py): alive with the partition
        # one rank: a tied weight of a group without hooks sends only its embedding's rows, into its .grad
        into_grad = {id(p) for g in self.groups if self._hookless(g) for p in g.params if id(p) in per_use}
        per_use = per_use - into_grad
        # one rank: groups that keep autograd's gradients and route no use take them when the backward ends
        self._taken_at_end = [g for g in self.groups if self._takes_at_end(g, per_use)]
        at_end = {id(p) for g in self._taken_at_end for p in g.params}
        for g in self.groups:
            for i, p in enumerate(g.params):
                hooked = id(p) not in at_end  # (taken at the end: a gradient made whole is the one kept, no rows)
                if hooked:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_grad_hook(g, i)))
                if hooked and len(g.shapes[i]) == 2:  # slices straight into the flat buffer; the hook (run after,
                    # no gradient) counts. (The recorded shape: a released stage-3 parameter is empty.)
                    self._row_sinks.append(functools.partial(g.add_grad_rows, i))
                    offer_rows(p, self._row_sinks[-1])
                if id(p) in per_use:
                    sinks[id(p)] = UseSinks(functools.partial(self._dense_use_arrived, g, i),
                                            functools.partial(self._rows_arrived, g, i),
                                            functools.partial(self._dense_use_made, g))
                elif id(p) in into_grad:
                    sinks[id(p)] = UseSinks(None, rows_into_grad(p), _nothing)
        self.use_grads = UseGrads(model, sinks, on_replay=self._holder_replayed)
        for g in self.groups:
            for i, p in enumerate(g.params):
                if id(p) in per_use:
                    g.arrival.route_per_use(i, by_rows=id(p) in self.use_grads.row_receivers)
        if self.stage.gathers_after_step:  # every unit, the root included, waits for its post-step all-gather before
            for unit in self.units if self.dp.size > 1 else []:  # its forward (one rank: nothing to wait for)
                self._hooks.append(unit.module.register_forward_pre_hook(eager(self._make_wait_hook(unit))))
            # and any state_dict() for all of them, even called on the model
            self._hooks.append(model.register_state_dict_pre_hook(lambda *args: self.wait_all()))
        resident = all(g.resident for g in self.groups + self.frozen)  # one rank in fp32: nothing moves
        self.stage3 = (Stage3Scheduler(self.units[:-1], self.root, prefetch, self.pool, hooked=not resident)
                       if self.stage.shards_parameters else None)
        if self.stage.shards_parameters:
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
            for g in unit.groups:
                g.wait_pending()
        return hook

    def after_forward(self) -> None:
        if self.stage3 is not None:
            self.stage3.end_forward()
            if torch.is_grad_enabled() and self._root_trusted() and not self.root.persistent:
                for g in self.root.groups:
                    if self._rows_only(g):
                        g.release()

    def _root_trusted(self) -> bool:
        """Stage 3: a first backward showed no use of a root parameter outside its holders and no holder
        replayed inside backward, so nothing in backward reads a root value its holders do not (the early
        root release's condition, ``_maybe_release_root``)."""
        return self.release_root_early and self._backwards_seen > 0 and not self.root.frozen

    @staticmethod
    def _rows_only(group: FlatParamGroup) -> bool:
        """A root group of plain embeddings' weights only (each a per-use parameter whose gradient comes by
        rows) that no dense holder used in this forward: after the forward nothing reads its values (an
        embedding's backward runs on its detached weight's rows, ``use_grads.py``), so its gathered buffer is
        freed at the forward's end rather than held through backward (see note: embeddings released). Not in a
        persistent root (under ``stage3_param_persistence_threshold``): its post-step gather refills the buffer."""
        every = set(range(len(group.params)))
        return group.arrival.per_use == every and group.arrival.row_params == every and group.arrival.dense_uses_back()

    # -- backward -----------------------------------------------------------------------------
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
        return {id(p) for g in self.groups if g.keeps_grads for p in g.params if id(p) not in shared}

    @property
    def early_per_use(self) -> bool:
        """Stages 2-3: per-use groups are reduced early and embeddings' rows sparsely. Not at one rank where every group
        keeps autograd's gradients: nothing is reduced, and a per-use parameter's uses go into its kept gradient as
        at stages 0-1 (``FlatParamGroup._keeps_uses``; see note: one-rank tied uses)."""
        return self.stage.shards_gradients and not self._all_keep

    @property
    def reduce_this_backward(self) -> bool:
        """Gradients are reduced in this backward: at every one at stages 2-3, at the boundary at 0-1."""
        return self.at_boundary or self.stage.shards_gradients

    def _holder_replayed(self) -> None:
        self.release_root_early = False
    def _dense_use_made(self, group: FlatParamGroup) -> None:
        """Forward: a holder of one of ``group``'s per-use parameters ran; one more gradient to wait for."""
        group.arrival.dense_use_made()

    def _dense_use_arrived(self, group: FlatParamGroup, index: int, grad: torch.Tensor) -> None:
        """A holder's use delivered ``grad`` (added into the flat buffer). The early reduction this may allow
        starts at the next gradient hook or at the end of backward, not here: ``grad`` (a table-sized tied
        head's gradient) is alive until this returns, and the reduction's landing shard beside it would raise
        the peak by the shard."""
        group.dense_use_arrived(index, grad)
        self._deferred.append(group)

    def _reduce_deferred(self) -> None:
        """Start the early reductions ``_dense_use_arrived`` left (every rank at the same hook: one graph)."""
        while self._deferred:
            self._maybe_reduce_early(self._deferred.pop(0))

    def _rows_arrived(self, group: FlatParamGroup, index: int, ids: torch.Tensor, sums: torch.Tensor,
                      tokens: int) -> None:
        """An embedding's per-token sums: kept for the sparse reduction at stages 2-3 (``row_reduce.py``),
        else added into the flat buffer, which lives until the boundary anyway."""
        if self.early_per_use:
            group.arrival.keep_rows(index, ids, sums, tokens)
        else:
            group.add_rows(index, ids, sums)

    def _maybe_reduce_early(self, group: FlatParamGroup) -> None:
        """Stages 2-3: reduce a per-use group's flat gradient as soon as every counted parameter and every
        dense use made in the forward has delivered (the tied head's gradient, at the start of backward),
        instead of holding it to the end. Anything arriving later is reduced again at the end and added."""
        if (self.early_per_use and id(group) not in self._ready and group.arrival.dense_uses_back()
                and group.grad_full is not None and group.arrival.all_counted()):
            self._group_ready(group)

    def _maybe_release_root(self) -> None:
        """Stage 3: once every root group's gradients are in, nothing left in this backward reads the root's
        values (its holders' uses have run, embeddings run on detached weights), so its gathered buffer is
        freed then instead of at the end of backward. Only after a first backward showed no use outside
        the holders and no holder replayed inside backward (either could read the values later)."""
        if (self.stage3 is not None and self._root_trusted()
                and any(g.arrival.per_use for g in self.root.groups)  # (its holders' hooks are what tell a use outside)
                and all(id(g) in self._ready or self._only_rows_to_come(g) for g in self.root.groups)):
            self.root.release()  # (frozen weights: read to the end)

    @staticmethod
    def _only_rows_to_come(group: FlatParamGroup) -> bool:
        """A per-use group holding no dense gradient and waiting for none: only embedding rows are left to
        come, and an embedding runs on its detached weight (``use_grads.py``), so the values are not read."""
        arrival = group.arrival
        return bool(arrival.per_use) and group.grad_full is None and arrival.dense_uses_back() and arrival.all_counted()

    def begin_backward(self, reduce: bool) -> None:
        """``reduce``: reduce gradients in this backward (always at stages 2-3, at the boundary at 0-1)."""
        self.at_boundary = reduce
        self._ready.clear()
        self.pool.open("backward" if reduce else "backward, accumulating")  # to end_backward (note: buffer pool)
        for u in self.units:
            u.begin_backward()
        for g in self._taken_at_end:  # (accumulating: this backward's gradients are fresh in .grad, added to the kept)
            g.kept.out_of_grad()

    def _hookless(self, group: FlatParamGroup) -> bool:
        """One rank (see note: one-rank hooks): ``group`` keeps autograd's gradients and, at stage 3, stays gathered,
        so nothing is reduced or released when one of its gradients arrives."""
        return group.keeps_grads and (group.resident or not self.stage.shards_parameters)

    def _takes_at_end(self, group: FlatParamGroup, per_use: set[int]) -> bool:
        """``_hookless`` and none of ``group``'s parameters routes its uses: its gradients are taken from ``.grad``
        when the backward ends (``_take_at_end``), not by a hook each."""
        return self._hookless(group) and not any(id(p) in per_use for p in group.params)

    def _take_at_end(self) -> None:
        """The gradients of the groups ``_takes_at_end`` chose, each as its hook would have taken it: in the usual
        case (every gradient in .grad, none held yet) all groups' at once (see note: one-rank take at once)."""
        groups = self._taken_at_end
        at_once = all([g.may_keep_all() for g in groups]) and keep_all_at_once([g.kept for g in groups],
                                                                              [g.params for g in groups])
        for g in groups:
            if at_once or (g.may_keep_all() and g.kept.keep_all(g.params)):
                g.arrival.seen()
                self._group_ready(g, reduce=False)  # (one rank: nothing to reduce)
                continue
            for i, p in enumerate(g.params):
                if p.grad is not None or g.arrival.came_by_rows(i, clear=False):
                    self._arrived(g, i, p)

    def _make_grad_hook(self, group: FlatParamGroup, index: int):
        def hook(param: torch.nn.Parameter) -> None:
            self._arrived(group, index, param)
        return hook

    def _arrived(self, group: FlatParamGroup, index: int, param: torch.nn.Parameter) -> None:
        """Parameter ``index`` of ``group`` has its gradient in ``.grad`` (or sent it by rows): keep it, or add
        it into the flat buffer, and reduce the group once every gradient is in."""
        self._reduce_deferred()
        grad = param.grad
        by_rows = group.arrival.came_by_rows(index)  # its gradient went into the flat buffer by rows
        if grad is None and not by_rows and group.arrival.routed(index):  # its uses' gradients went there
            return
        if group.arrival.routed(index):  # a use outside its holders: its saved tensors may need the values late
            self.release_root_early = False
        if grad is None and not by_rows:  # torch calls this hook only after accumulating a gradient
            raise RuntimeError(f"{group.name}: parameter {index} reached its gradient hook without a gradient")
        param.grad = None
        # one rank: kept as autograd made it (see note: one-rank gradients); None: counted only
        if grad is None or not group.keep_grad(index, grad):
            group.accumulate_grad(index, grad)
        if group.arrival.per_use:
            self._maybe_reduce_early(group)
        elif group.arrival.all_counted():
            self._group_ready(group)

    def _group_ready(self, group: FlatParamGroup, reduce: bool = True) -> None:
        """``group``'s gradients are all in: reduce them (unless ``reduce`` is false: a per-use group whose
        only gradients are embedding rows, or one rank's group kept whole) and do the unit's bookkeeping."""
        if id(group) in self._ready:
            return
        self._ready.add(id(group))
        if reduce and self.reduce_this_backward:
            self.reducer.reduce(group)
            self._in_flight.append(group)
            while len(self._in_flight) > MAX_GROUPS_IN_FLIGHT:
                self._in_flight.popleft().wait_pending()
        group.arrival.restart_count()
        unit = self._unit_of_group[id(group)]
        if unit.group_done() and self.stage3 is not None:
            self.stage3.on_unit_grads_done(unit)
        if unit.is_root:
            self._maybe_release_root()

    def end_backward(self) -> None:
        """Reduce groups some of whose parameters got no gradient, then wait for every reduction. A
        group with no gradient at all waits for the boundary at stage 2 (a pipeline chunk's backward
        touches only its own groups; the others are reduced in their own backwards)."""
        self._take_at_end()
        self._reduce_deferred()
        with_rows = []
        for g in self.groups:  # fixed order: every rank issues the same collectives
            untouched_until_boundary = (self.stage is ZeroStage.GRADIENTS and g.grad_full is None
                                        and not self.at_boundary and not g.arrival.rows)
            if g.arrival.per_use and self.early_per_use and not untouched_until_boundary:
                self._finish_per_use(g)
                with_rows += [g] if g.arrival.row_params else []
            elif id(g) not in self._ready and (g.grad_full is not None or self.reduce_this_backward) \
                    and not untouched_until_boundary:
                self._group_ready(g)
            g.arrival.end_backward()
        self.pool.close()  # every unit of this backward is gathered
        for g in self.groups:
            g.wait_pending()
        self._in_flight.clear()
        self._backwards_seen += 1
        shard_dtype = torch.float32 if self.reducer.accumulate_fp32 else None
        for g in with_rows:  # after the dense reductions landed: their first one writes the shard
            reduce_rows(g, g.arrival.take_rows(), 1.0 / self.dp.size, shard_dtype or g.compute_dtype)
        if self.stage3 is not None:
            self.stage3.end_backward()

    def _finish_per_use(self, group: FlatParamGroup) -> None:
        """End of backward, stages 2-3: reduce what a per-use group still holds densely. Whether any rank
        holds something is agreed first (a one-element all-reduce), so every rank issues the same
        collectives; a group whose only gradients are embedding rows reduces nothing dense."""
        anything = group.dp.max_flag(group.grad_full is not None)
        if id(group) not in self._ready:  # without dense gradients anywhere the rows alone make the shard
            self._group_ready(group, reduce=anything or not group.arrival.row_params)
        elif anything:  # arrived after the early reduction (a use outside its holders): added to it
            self.reducer.reduce(group)

    # -- after the optimizer step ------------------------------------------------------------
    def _push_masters(self) -> None:
        """Write every master into its low-precision parameters (stages 1-2 also start the
        all-gathers), root first: the next forward needs the embeddings before any block."""
        for g in self.root.groups + [g for u in self.units[:-1] for g in u.groups]:
            handle = g.master_to_params()
            if handle is not None and g.dp.size == 1:  # (complete: no forward hook waits at one rank)
                handle.wait()
            elif handle is not None:
                g.pending.append(handle)

    def after_step(self) -> None:
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
        for g in self.groups:
            g.wait_pending()

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
        self._taken_at_end = []
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
