"""One flat group's gradient: where it is held in one step, its reductions in flight, and how it arrives.

A group's gradient lives in up to three stores, each counted in the ledger as ``grad``:

- ``kept``: autograd's own gradient tensors, held as they are (one rank in fp32, ``keeps``; ``kept_grads.py``);
- ``flat``: the flat gradient, ``padded_numel`` elements in the compute dtype, each parameter a view of it;
  left uninitialised when made, ``written`` saying which views hold values (zeroing it first would write every
  byte twice);
- ``reduced``: the reduced gradient of this rank's owned range (``owned_numel``; fp32 when micro-batches
  accumulate, else the reduction's dtype), written by a reduction or adopted whole at one rank.

``state`` reads which of them is live, so it cannot disagree with the storage. The moves, all here:

===============  ==============================================  =========================================
state            what holds the gradient                         left by
===============  ==============================================  =========================================
``EMPTY``        nothing (after the step, or before the first)   ``accumulate``/``add_rows``: ``FLAT``;
                                                                 ``keep``: ``KEPT``
``KEPT``         ``kept`` only (one rank)                        a flat buffer made: the kept move in,
                                                                 ``FLAT``; the step takes them (``free``)
``FLAT``         ``flat`` (and ``reduced``, when a later         a reduction issued (``drop_flat`` or
                 micro-batch accumulates onto an earlier one's)  ``adopt_reduced``): ``REDUCING``/``REDUCED``
``REDUCING``     a reduction in ``pending`` writes ``reduced``   ``wait``: ``REDUCED``
``REDUCED``      ``reduced`` only                                the step reads it, ``free``: ``EMPTY``
===============  ==============================================  =========================================

``pending`` holds the reductions' handles in issue order (their completions add into ``reduced`` in that order,
so the sums are the same every run); the flat gradients they still read are dropped from the group but stay
counted until ``wait`` (gloo's worker may drop the last reference a moment later, and counting until the
storage died made the gradient's peak depend on thread timing). ``arrival`` (``grad_arrival.py``) says which
parameters' gradients of one backward are in and by which route; the backward schedule (``grad_schedule.py``)
decides from it when the group reduces. See note: group gradient; see note: one-rank gradients.
"""
from __future__ import annotations

import enum
from typing import Any

import torch

from ..collectives import Handle
from ..ledger import Category, Ledger
from .grad_arrival import GradArrival
from .kept_grads import KeptGrads


class GradState(enum.Enum):
    """Which store holds a group's gradient now (``GroupGrad.state``; the table in this module's docstring)."""

    EMPTY = "empty"
    KEPT = "kept"
    FLAT = "flat"
    REDUCING = "reducing"
    REDUCED = "reduced"


class GroupGrad:
    """The gradient of one flat group: its stores, its reductions in flight and its arrival."""

    def __init__(self, name: str, shapes: list[torch.Size], offsets: list[int], padded_numel: int,
                 owned_numel: int, dtype: torch.dtype, device: torch.device, ledger: Ledger, keeps: bool,
                 partitions: bool) -> None:
        """``shapes``/``offsets``: the parameters' shapes and places in the flat layout; ``keeps``: autograd's
        gradients are kept as they are (one rank in fp32); ``partitions``: stages 1-3 (the gradient is settled into
        the reduced one of the owned range)."""
        self.name = name
        self._shapes, self._offsets = shapes, offsets
        self._numels = [s.numel() for s in shapes]
        self._numel = offsets[-1] + self._numels[-1] if shapes else 0
        self.padded_numel, self.owned_numel = padded_numel, owned_numel
        self.dtype, self.device, self._ledger = dtype, device, ledger
        self.keeps, self._partitions = keeps, partitions
        self.kept = KeptGrads(self._numels, dtype, ledger)
        self.flat: torch.Tensor | None = None
        self.written: list[bool] = []  # which parameters' views of ``flat`` hold values
        self.reduced: torch.Tensor | None = None
        self.pending: list[Handle] = []
        self._read_by_pending: list[torch.Tensor] = []  # dropped flat gradients the pending reductions read
        self.arrival = GradArrival(len(shapes))

    @property
    def state(self) -> GradState:
        if self.pending:
            return GradState.REDUCING
        if self.flat is not None:
            return GradState.FLAT
        if self.reduced is not None:
            return GradState.REDUCED
        return GradState.KEPT if self.kept.holds() else GradState.EMPTY

    # -- arrival -------------------------------------------------------------------------------------
    def accumulate(self, index: int, grad: torch.Tensor | None) -> None:
        """Add one parameter's gradient into the flat gradient (made on first use): the first gradient since the
        buffer was made is copied in, later ones added. ``None``: it came by rows (``add_slice``), only counted."""
        if grad is not None:
            view = self._view(index)
            if self.written[index]:
                view.add_(grad)  # no flattening copy of a strided grad
            else:
                view.copy_(grad)
                self.written[index] = True
        self.arrival.seen(index)

    def dense_use_arrived(self, index: int, grad: torch.Tensor, early: bool) -> None:
        """A holder's use of parameter ``index`` delivered ``grad``: added in (kept as it is when ``keeps_uses``),
        one fewer to wait for. ``early``: the backward reduces per-use groups early (``BackwardSchedule``)."""
        if not (self._keeps_uses(early) and self.kept.keep(index, grad)):
            self.accumulate(index, grad)
        self.arrival.dense_use_back()

    def _keeps_uses(self, early: bool) -> bool:
        """One rank, uses not reduced early, no flat gradient yet: a per-use parameter's dense uses and rows go into
        its kept gradient, as they would into its view of the flat buffer, which nothing else needs then (see note:
        one-rank tied uses)."""
        return self.keeps and not early and self.flat is None and self.reduced is None

    def keep(self, index: int, grad: torch.Tensor) -> bool:
        """One rank (``keeps``): hold autograd's gradient of parameter ``index`` as it is, or add a later one into
        it; False (nothing done) when it must go into the flat buffer instead: a flat buffer exists already, its uses
        send it (``per_use``), or it does not own its storage whole (a view would keep all of it)."""
        if (not self.keeps or self.flat is not None or self.reduced is not None
                or self.arrival.routed(index) or not self.kept.keep(index, grad)):
            return False
        self.arrival.seen(index)
        return True

    def may_keep_all(self) -> bool:
        """``keep`` may take every ``.grad`` at once (``KeptGrads.keep_all``; ``arrival.seen()`` then): one rank, no
        flat buffer, no use routed, nothing sent by rows."""
        return (self.keeps and self.flat is None and self.reduced is None
                and not self.arrival.per_use and not self.arrival.any_by_rows())

    def add_slice(self, index: int, start: int, values: torch.Tensor, last: bool) -> None:
        """Rows ``start..start+len(values)`` of parameter ``index``'s gradient (``activations/grad_rows.py``), copied
        in or added as ``accumulate`` would the whole gradient: the slices of one gradient are disjoint, so the
        parameter counts as written only once its ``last`` slice is in."""
        view = self._view(index)[start:start + values.shape[0]]
        if self.written[index]:
            view.add_(values)
        else:
            view.copy_(values)
        if last:
            self.written[index] = True
            self.arrival.arrived_by_rows(index)

    def add_rows(self, index: int, rows: torch.Tensor, values: torch.Tensor, early: bool) -> None:
        """Add ``values[k]`` into row ``rows[k]`` of a 2-D parameter's gradient (distinct rows: an embedding's
        tokens, ``use_grads.py``): into its kept gradient if it has one (``_keeps_uses``)."""
        kept = self.kept[index] if self._keeps_uses(early) else None
        if kept is not None:
            kept.index_add_(0, rows, values)
            return
        view = self._view(index)
        if not self.written[index]:
            view.zero_()
            self.written[index] = True
        view.index_add_(0, rows, values)

    # -- reading -------------------------------------------------------------------------------------
    def kept_whole(self) -> list[torch.Tensor] | None:
        """Every parameter's kept gradient, when each parameter has one and they are all there is (no flat buffer,
        no reduced gradient); else None."""
        if self.flat is not None or self.reduced is not None:
            return None
        return self.kept.whole()

    def of(self, index: int) -> torch.Tensor | None:
        """Parameter ``index``'s gradient as this rank holds it now, in its shape: kept (one rank), its view of the
        flat buffer, or of the reduced gradient when this rank owns the whole group; None if none of these."""
        if self.kept[index] is not None:
            return self.kept[index]
        off, n = self._offsets[index], self._numels[index]
        flat = self.flat if self.flat is not None else (
            self.reduced if self.owned_numel == self.padded_numel else None)
        return None if flat is None else flat[off:off + n].view(self._shapes[index])

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor holding this gradient now (``offload_states`` moves them)."""
        return [self.flat, self.reduced, *self.kept]

    # -- the flat buffer -----------------------------------------------------------------------------
    def _view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view of the flat gradient (made if none exists)."""
        off, n = self._offsets[index], self._numels[index]
        return self._buffer()[off:off + n].view(self._shapes[index])

    def _buffer(self) -> torch.Tensor:
        """The flat gradient as it is; a new one is left uninitialised but for its padding (``written``)."""
        if self.flat is None:
            self.flat = self._ledger.empty(self.padded_numel, self.dtype, Category.GRAD, self.device)
            self.flat[self._numel:].zero_()
            self.written = [False] * len(self._shapes)
            for index in self.kept.move_into(self._view):  # gradients kept so far (one rank) move in
                self.written[index] = True
        return self.flat

    def ensure_flat(self) -> torch.Tensor:
        """The whole flat gradient, with zeros where no parameter's gradient arrived (unused parameters still
        reduce); made if none did."""
        grad = self._buffer()
        for index, written in enumerate(self.written):
            if not written:
                self._view(index).zero_()
                self.written[index] = True
        return grad

    def settle_kept(self) -> None:
        """The kept gradients go into the flat buffer (zeros where a parameter has none), and at stages 1-3 into the
        reduced gradient, as the one-rank reduction (``grad_reducer._keep_whole``) would have put them."""
        if not self.kept.holds():
            return
        grad = self.ensure_flat()
        if self._partitions:
            if self.reduced is None:
                self.adopt_reduced(grad)
            else:
                self.reduced.add_(grad)
            self.drop_flat()

    def drop_flat(self) -> None:
        """A reduction was issued (stages 1-3): the flat gradient is dropped; what the pending reductions still read
        stays counted until ``wait``."""
        if self.pending and self.flat is not None and self.flat is not self.reduced:
            self._read_by_pending.append(self.flat)
        self.flat = None

    # -- the reduced gradient ------------------------------------------------------------------------
    def adopt_reduced(self, grad: torch.Tensor) -> None:
        """One rank owns everything: the flat gradient ``grad`` becomes the reduced one, no copy."""
        self.reduced = grad

    def new_reduced(self, dtype: torch.dtype) -> torch.Tensor:
        """A reduced gradient of the owned range in ``dtype``, left for a reduction to write; refused if one exists
        (two reductions in one step would lose the first)."""
        if self.reduced is not None:
            raise RuntimeError(f"{self.name}: reduced twice in one step without accumulation")
        self.reduced = self._ledger.empty(self.owned_numel, dtype, Category.GRAD, self.device)
        return self.reduced

    def ensure_reduced(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reduced gradient of the owned range, zeros in ``dtype`` if none exists yet."""
        if self.reduced is None:
            self.reduced = self._ledger.zeros(self.owned_numel, dtype, Category.GRAD, self.device)
        return self.reduced

    def issued(self, handle: Handle) -> None:
        """A reduction of this gradient is in flight; ``wait`` lands it."""
        self.pending.append(handle)

    def wait(self) -> None:
        """Land every reduction in flight, in issue order, and stop counting the flat gradients they read."""
        if self.pending:
            for handle in self.pending:
                handle.wait()
            self.pending.clear()
        if self._read_by_pending:
            for grad in self._read_by_pending:
                self._ledger.release(grad)
            self._read_by_pending.clear()

    def free(self) -> None:
        """After the step: nothing held (``EMPTY``), the arrival count restarted."""
        self.flat = None
        self.kept.drop()
        self.reduced = None
        self.arrival.restart_count()

    def __repr__(self) -> str:
        info: dict[str, Any] = {"state": self.state.value, "pending": len(self.pending)}
        return f"GroupGrad({self.name}, {info})"
