"""When a backward's gradients are reduced: each flat group's reduction, scheduled as its gradients arrive.

Stages 0 and 1 reduce at the accumulation boundary only (gradients
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

The partition (``partition.py``) builds the units and puts the hooks on the model; its gradient hooks, per-use
sinks and replay callback call this schedule (``arrived``, ``dense_use_arrived``, ``rows_arrived``,
``dense_use_made``, ``holder_replayed``), and the engine's backward brackets it (``begin``, ``end``).
Memory: the bookkeeping of which groups are ready and in flight; the flat gradients and comm buffers are the
groups' (``flat_group.py``), at most about ``MAX_GROUPS_IN_FLIGHT`` of them in flight.
See note: one reduction in flight; see note: early per-use reduction; see note: one-rank take at once
(docs/design-notes.md).
"""
from __future__ import annotations

import collections

import torch

from ..activations.choices import TechniqueChoice
from ..collectives import Collectives
from ..config import ZeroStage
from .buffer_pool import BufferPool
from .flat_group import FlatParamGroup, wait_all
from .grad_reducer import GradReducer
from .kept_grads import KeepAllAtOnce
from .row_reduce import choose_dense, reduce_rows, row_widths
from .stage3 import Stage3Scheduler
from .units import Unit

# Reductions still in flight when the next one starts; older ones are waited on, which bounds
# the flat gradients and comm buffers alive during backward to about this many groups.
MAX_GROUPS_IN_FLIGHT = 1  # see note: one reduction in flight


class BackwardSchedule:
    """Which of ``units``' flat groups are ready, reduced and in flight in the current backward, and what the
    root's early release may assume. Set by the partition as it hooks the model: ``taken_at_end``, one rank's
    groups whose gradients are taken from ``.grad`` when the backward ends instead of by a hook each; ``stage3``,
    stage 3's scheduler, told when a unit's gradients are all in."""

    def __init__(self, stage: ZeroStage, dp: Collectives, units: list[Unit], reducer: GradReducer,
                 pool: BufferPool, rows: TechniqueChoice | None = None) -> None:
        """``rows``: whether embeddings send rows (``zeroplus.embedding_rows``, agreed by every rank; None: always);
        where they do not, no rows are reduced at the end of backward."""
        self.stage = stage
        self.dp = dp
        self.units = units
        self.root = units[-1]
        self.groups: list[FlatParamGroup] = [g for u in units for g in u.groups]
        self.reducer = reducer
        self.pool = pool
        self.rows = rows
        self.stage3: Stage3Scheduler | None = None
        self._taken_at_end: list[FlatParamGroup] = []
        self._keep_all = KeepAllAtOnce([], [])
        self._all_taken = False  # (taken_at_end)
        self._all_keep = bool(self.groups) and all(g.gradient.keeps for g in self.groups)  # one rank (early_per_use)
        self._in_flight: collections.deque[FlatParamGroup] = collections.deque()
        self.at_boundary = True  # this backward ends an accumulation (begin)
        self._ready: set[int] = set()
        self._unit_of_group = {id(g): u for u in units for g in u.groups}
        self._deferred: list[FlatParamGroup] = []  # per-use groups whose dense use just arrived (dense_use_arrived)
        self.release_root_early = True  # cleared for good by a use outside the holders or a replay
        # whether a gradient can reach a per-use group after its early reduction (a use outside its holders, a
        # holder replayed inside backward): agreed by every rank at the end of the first backward that reduces one;
        # None until then (see note: early per-use reduction)
        self.late_uses: bool | None = None
        self._backwards_seen = 0

    @property
    def taken_at_end(self) -> list[FlatParamGroup]:
        """One rank's groups whose gradients are taken from ``.grad`` when the backward ends (set by the partition;
        what taking them all at once reads is laid out when set)."""
        return self._taken_at_end

    @taken_at_end.setter
    def taken_at_end(self, groups: list[FlatParamGroup]) -> None:
        self._taken_at_end = groups
        self._keep_all = KeepAllAtOnce([g.gradient.kept for g in groups], [g.params for g in groups])
        # every group taken at the end (one rank, none routes a use: ``early_per_use`` is off, no rows are kept)
        self._all_taken = bool(groups) and groups == self.groups and self._all_keep  # (groups compare as objects)

    def root_trusted(self) -> bool:
        """Stage 3: a first backward showed no use of a root parameter outside its holders and no holder
        replayed inside backward, so nothing in backward reads a root value its holders do not (the early
        root release's condition, ``_maybe_release_root``)."""
        return self.release_root_early and self._backwards_seen > 0 and not self.root.frozen

    @property
    def early_per_use(self) -> bool:
        """Stages 2-3: per-use groups are reduced early and embeddings' rows sparsely. Not at one rank where every group
        keeps autograd's gradients: nothing is reduced, and a per-use parameter's uses go into its kept gradient as
        at stages 0-1 (``GroupGrad._keeps_uses``; see note: one-rank tied uses)."""
        return self.stage.shards_gradients and not self._all_keep

    @property
    def reduce_this_backward(self) -> bool:
        """Gradients are reduced in this backward: at every one at stages 2-3, at the boundary at 0-1."""
        return self.at_boundary or self.stage.shards_gradients

    def holder_replayed(self) -> None:
        self.release_root_early = False
    def dense_use_made(self, group: FlatParamGroup) -> None:
        """Forward: a holder of one of ``group``'s per-use parameters ran; one more gradient to wait for."""
        group.gradient.arrival.dense_use_made()

    def dense_use_arrived(self, group: FlatParamGroup, index: int, grad: torch.Tensor) -> None:
        """A holder's use delivered ``grad`` (added into the flat buffer). The early reduction this may allow
        starts at the next gradient hook or at the end of backward, not here: ``grad`` (a table-sized tied
        head's gradient) is alive until this returns, and the reduction's landing shard beside it would raise
        the peak by the shard."""
        self._refuse_late(group, index)
        group.gradient.dense_use_arrived(index, grad, self.early_per_use)
        self._deferred.append(group)

    def _refuse_late(self, group: FlatParamGroup, index: int) -> None:
        """A gradient for a per-use group already reduced in this backward, where the ranks agreed no such late use
        happens (``late_uses`` False: its reduction is not repeated, so it would be lost): refused, loudly."""
        if self.late_uses is False and id(group) in self._ready and group.gradient.arrival.per_use:
            raise RuntimeError(
                f"rank {self.dp.rank}: a gradient of {group.name}'s parameter {group.names[index]} arrived after the "
                f"group was reduced (a use outside the modules holding it, or one replayed inside backward), which "
                f"the first backward showed on no rank; zeroplus reduces such groups once at the end of backward "
                f"only where the first backward shows one: use the parameter the same way from the first step")

    def _reduce_deferred(self) -> None:
        """Start the early reductions ``dense_use_arrived`` left (every rank at the same hook: one graph)."""
        while self._deferred:
            self._maybe_reduce_early(self._deferred.pop(0))

    def rows_arrived(self, group: FlatParamGroup, index: int, ids: torch.Tensor, sums: torch.Tensor,
                      tokens: int) -> None:
        """An embedding's per-token sums: kept for the sparse reduction at stages 2-3 (``row_reduce.py``),
        else (or once the group's rows were found to cost more than its dense gradient, ``row_reduce.choose_dense``)
        added into the flat buffer, which lives until the boundary anyway or is reduced when the backward ends."""
        if self.early_per_use and not group.gradient.arrival.rows_dense:
            group.gradient.arrival.keep_rows(index, ids, sums, tokens)
        else:
            group.gradient.add_rows(index, ids, sums, self.early_per_use)

    def _maybe_reduce_early(self, group: FlatParamGroup) -> None:
        """Stages 2-3: reduce a per-use group's flat gradient as soon as every counted parameter and every
        dense use made in the forward has delivered (the tied head's gradient, at the start of backward),
        instead of holding it to the end. Anything arriving later is reduced again at the end and added."""
        gradient = group.gradient
        if (self.early_per_use and id(group) not in self._ready and gradient.arrival.dense_uses_back()
                and gradient.flat is not None and gradient.arrival.all_counted()):
            self._group_ready(group)

    def _maybe_release_root(self) -> None:
        """Stage 3: once every root group's gradients are in, nothing left in this backward reads the root's
        values (its holders' uses have run, embeddings run on detached weights), so its gathered buffer is
        freed then instead of at the end of backward. Only after a first backward showed no use outside
        the holders and no holder replayed inside backward (either could read the values later)."""
        if (self.stage3 is not None and self.root_trusted()
                and any(g.gradient.arrival.per_use for g in self.root.groups)  # (its holders' hooks tell a use outside)
                and all(id(g) in self._ready or self._only_rows_to_come(g) for g in self.root.groups)):
            self.root.release()  # (frozen weights: read to the end)

    @staticmethod
    def _only_rows_to_come(group: FlatParamGroup) -> bool:
        """A per-use group holding no dense gradient and waiting for none: only embedding rows are left to
        come, and an embedding runs on its detached weight (``use_grads.py``), so the values are not read."""
        gradient, arrival = group.gradient, group.gradient.arrival
        return bool(arrival.per_use) and gradient.flat is None and arrival.dense_uses_back() and arrival.all_counted()

    def begin(self, reduce: bool) -> None:
        """``reduce``: reduce gradients in this backward (always at stages 2-3, at the boundary at 0-1)."""
        self.at_boundary = reduce
        self._ready.clear()
        self.pool.open("backward" if reduce else "backward, accumulating")  # to end_backward (note: buffer pool)
        for u in self.units:
            u.begin_backward()
        for g in self.taken_at_end:  # (accumulating: this backward's gradients are fresh in .grad, added to the kept)
            g.gradient.kept.out_of_grad()

    def _take_at_end(self) -> bool:
        """The gradients of the groups ``_takes_at_end`` chose, each as its hook would have taken it: in the usual
        case (every gradient in .grad, none held yet) all groups' at once (see note: one-rank take at once), and
        then, where those are every group, True and nothing more: no group is reduced, routes a use or sends rows,
        and nothing is in flight, so no group's count, unit or release waits on it (``end`` returns at once)."""
        groups = self.taken_at_end
        at_once = all([g.gradient.may_keep_all() for g in groups]) and self._keep_all()
        if at_once and self._all_taken:
            return True
        for g in groups:
            if at_once or (g.gradient.may_keep_all() and g.gradient.kept.keep_all(g.params)):
                g.gradient.arrival.seen()
                self._group_ready(g, reduce=False)  # (one rank: nothing to reduce)
                continue
            for i, p in enumerate(g.params):
                if p.grad is not None or g.gradient.arrival.came_by_rows(i, clear=False):
                    self.arrived(g, i, p)
        return False

    def arrived(self, group: FlatParamGroup, index: int, param: torch.nn.Parameter) -> None:
        """Parameter ``index`` of ``group`` has its gradient in ``.grad`` (or sent it by rows): keep it, or add
        it into the flat buffer, and reduce the group once every gradient is in."""
        self._reduce_deferred()
        grad, gradient = param.grad, group.gradient
        by_rows = gradient.arrival.came_by_rows(index)  # its gradient went into the flat buffer by rows
        if grad is None and not by_rows and gradient.arrival.routed(index):  # its uses' gradients went there
            return
        if gradient.arrival.routed(index):  # a use outside its holders: its saved tensors may need the values late
            self._refuse_late(group, index)
            self.release_root_early = False
        if grad is None and not by_rows:  # torch calls this hook only after accumulating a gradient
            raise RuntimeError(f"{group.name}: parameter {index} reached its gradient hook without a gradient")
        param.grad = None
        # one rank: kept as autograd made it (see note: one-rank gradients); None: counted only
        if grad is None or not gradient.keep(index, grad):
            gradient.accumulate(index, grad)
        if gradient.arrival.per_use:
            self._maybe_reduce_early(group)
        elif gradient.arrival.all_counted():
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
                self._in_flight.popleft().gradient.wait()
        group.gradient.arrival.restart_count()
        unit = self._unit_of_group[id(group)]
        if unit.group_done() and self.stage3 is not None:
            self.stage3.on_unit_grads_done(unit)
        if unit.is_root:
            self._maybe_release_root()

    def end(self) -> None:
        """Reduce groups some of whose parameters got no gradient, then wait for every reduction. A
        group with no gradient at all waits for the boundary at stage 2 (a pipeline chunk's backward
        touches only its own groups; the others are reduced in their own backwards)."""
        if self._take_at_end():  # (one rank, every group kept whole at once)
            self.pool.close()
            self._backwards_seen += 1
            if self.stage3 is not None:
                self.stage3.end_backward()
            return
        self._reduce_deferred()
        with_rows = []
        for g in self.groups:  # fixed order: every rank issues the same collectives
            untouched_until_boundary = (self.stage is ZeroStage.GRADIENTS and g.gradient.flat is None
                                        and not self.at_boundary and not g.gradient.arrival.rows)
            if g.gradient.arrival.per_use and self.early_per_use and not untouched_until_boundary:
                self._finish_per_use(g)
                with_rows += [g] if (g.gradient.arrival.row_params and not g.gradient.arrival.rows_dense
                                     and (self.rows is None or self.rows.on)) else []
            elif id(g) not in self._ready and (g.gradient.flat is not None or self.reduce_this_backward) \
                    and not untouched_until_boundary:
                self._group_ready(g)
            g.gradient.arrival.end_backward()
        self.pool.close()  # every unit of this backward is gathered
        wait_all(self.groups)
        self._in_flight.clear()
        self._backwards_seen += 1
        if self.late_uses is None and self.early_per_use and any(g.gradient.arrival.per_use for g in self.groups):
            self.late_uses = self.dp.max_flag(not self.release_root_early)  # (once: a read on the host)
        shard_dtype = torch.float32 if self.reducer.accumulate_fp32 else None
        for g in with_rows:  # after the dense reductions landed: their first one writes the shard
            rows = g.gradient.arrival.take_rows()
            widest = row_widths(g, rows)
            if choose_dense(g, widest):  # as every later backward will: into the flat gradient, reduced
                for i, parts in sorted(rows.items()):
                    for ids, sums, _ in parts:
                        g.gradient.add_rows(i, ids, sums, True)
                self.reducer.reduce(g)
                g.gradient.wait()
            else:
                reduce_rows(g, rows, widest, 1.0 / self.dp.size, shard_dtype or g.compute_dtype)
        if self.stage3 is not None:
            self.stage3.end_backward()

    def _finish_per_use(self, group: FlatParamGroup) -> None:
        """End of backward, stages 2-3: reduce what a per-use group still holds densely. Whether any rank
        holds something is agreed first (a one-element all-reduce), so every rank issues the same
        collectives; a group whose only gradients are embedding rows reduces nothing dense. A group whose rows
        go dense (``row_reduce.choose_dense``, the same on every rank) holds them now: reduced on every rank
        without asking (zeros where a rank holds nothing). A group reduced early where the ranks agreed no late use
        happens (``late_uses`` False) holds nothing more: nothing asked, nothing reduced."""
        gradient = group.gradient
        settled = id(group) in self._ready and self.late_uses is False  # (anything late is refused: _refuse_late)
        anything = gradient.arrival.rows_dense or not settled and group.dp.max_flag(gradient.flat is not None)
        if id(group) not in self._ready:  # without dense gradients anywhere the rows alone make the shard
            self._group_ready(group, reduce=anything or not group.gradient.arrival.row_params)
        elif anything:  # arrived after the early reduction (a use outside its holders): added to it
            self.reducer.reduce(group)
