"""One rank's kept gradients: autograd's own gradient tensors, held as they are for a flat group.

At world size 1 in fp32 nothing is reduced (``GroupGrad.keeps``), so a group's flat gradient buffer
would only be a copy. ``KeptGrads`` holds each parameter's gradient tensor as autograd made it, adds a later
micro-batch's into it in place, and counts them in the ledger as ``grad``: the c * P bytes the flat buffer would
hold, with no copy. A gradient is kept only if it owns its storage whole (its storage holds exactly its elements in
the group's dtype; one kept alone is asked to be contiguous too): a view would hold the rest of its storage uncounted.

Ledger entries: the gradients ``keep_all`` takes when the backward ends (every one of the group's: the usual
case) are one entry for the group, since an entry per gradient cost about 1.5 us each way, for a hundred or
more gradients a step. A gradient kept alone (``keep``, from a gradient hook) is an entry of its own.
``move_into`` hands them to a flat buffer when one is made after all; ``drop`` lets them go after the step.
A tied weight's uses are kept here too (its head's gradient as made, the embedding's rows added into it).
See note: one-rank gradients; see note: one-rank tied uses (docs/design-notes.md).

What ``keep_all`` takes stays each parameter's ``.grad`` too, as in the plain module, until ``out_of_grad`` (the
next backward begins, they move into a flat buffer, their storages are resized, the step drops them): the step
runs the optimizer over the parameters themselves with those gradients (``direct_step.py``), so no ``.grad`` is
cleared when the backward ends and set again for the step (about 1 us each). See note: one-rank grads in place.

``KeepAllAtOnce`` is ``keep_all`` for every group of a backward (one rank: all of them), each check made once over
all their gradients and the ledger entered once. See note: one-rank take at once; see note: one-rank step bookkeeping.
"""
from __future__ import annotations

from itertools import accumulate, chain, repeat
from operator import attrgetter, is_
from typing import Callable, Iterator

import torch

from ..ledger import Category, Ledger

_GRAD = attrgetter("grad")


class KeptGrads:
    """The kept gradient of each of a group's parameters (None where none is kept), in parameter order."""

    def __init__(self, numels: list[int], dtype: torch.dtype, ledger: Ledger) -> None:
        """``numels``: the parameters' sizes in elements, in order."""
        self.tensors: list[torch.Tensor | None] = [None] * len(numels)
        self._held = 0  # how many of ``tensors`` are not None (``holds`` and ``whole`` read it, not the list)
        self._dtype = dtype
        self._sizes = [n * dtype.itemsize for n in numels]  # the bytes of each gradient, which must own its storage
        self._total = sum(self._sizes)
        self._ledger = ledger
        self._entry: int | None = None  # the ledger entry of what ``keep_all`` took (None: an entry each)
        self._in_grad: list[torch.nn.Parameter] = []  # whose ``.grad`` is still what ``keep_all`` took

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.tensors)

    def __getitem__(self, index: int) -> torch.Tensor | None:
        return self.tensors[index]

    def holds(self) -> bool:
        return self._held > 0

    def whole(self) -> list[torch.Tensor] | None:
        """Every parameter's kept gradient, or None if one has none."""
        return list(self.tensors) if self._held == len(self.tensors) else None  # type: ignore[arg-type]

    def keep(self, index: int, grad: torch.Tensor) -> bool:
        """Keep ``grad`` as parameter ``index``'s (a ledger entry of its own), or add it into the one kept; False
        (nothing done) if none is kept and ``grad`` does not own its storage whole."""
        kept = self.tensors[index]
        if kept is not None:
            kept.add_(grad)
        elif self._whole_storage(grad) is not None:
            self.tensors[index] = self._ledger.count(grad, Category.GRAD)
            self._held += 1
        else:
            return False
        return True

    def keep_all(self, params: list[torch.nn.Parameter]) -> bool:
        """Keep every one of ``params``' ``.grad`` (left there until ``out_of_grad``), counted as one ledger entry, if
        each exists and owns its storage whole and none is kept yet; else False, nothing changed."""
        return KeepAllAtOnce([self], [params])()

    def _took(self, grads: list[torch.Tensor], params: list[torch.nn.Parameter], entry: int) -> None:
        self._entry, self.tensors, self._in_grad = entry, grads, params  # type: ignore[assignment]
        self._held = len(grads)

    def out_of_grad(self) -> None:
        """The parameters' ``.grad`` no longer shows the kept gradients (held here all the same)."""
        for p in self._in_grad:
            p.grad = None
        self._in_grad = []

    def move_into(self, view_of: Callable[[int], torch.Tensor]) -> list[int]:
        """Copy each kept gradient into ``view_of(index)`` and let it go, the ledger's count too (each once copied,
        ``keep_all``'s entry once all are); the indices copied."""
        self.out_of_grad()
        moved = []
        for index, grad in enumerate(self.tensors):
            if grad is not None:
                view_of(index).copy_(grad)
                self._ledger.release(grad)
                self.tensors[index] = None
                self._held -= 1
                moved.append(index)
        self._release_entry()
        return moved

    def drop(self) -> None:
        """Let every kept gradient go, and the ledger's count of them."""
        self.out_of_grad()
        if not self._release_entry():
            self._ledger.release_all(self.tensors)
        self.tensors = [None] * len(self.tensors)
        self._held = 0

    def resized(self) -> None:
        """Their storages were resized (``offload_states``): the ledger counts them at their sizes now, and no
        ``.grad`` shows a storage that may be empty."""
        self.out_of_grad()
        if self._entry is not None:
            self._ledger.recount(self._entry)

    def _release_entry(self) -> bool:
        key, self._entry = self._entry, None
        if key is not None:
            self._ledger.release_key(key)
        return key is not None

    def _whole_storage(self, g: torch.Tensor) -> torch.UntypedStorage | None:
        """``g``'s storage if ``g`` may be kept: the compute dtype, contiguous, and its storage's whole."""
        if g.dtype != self._dtype or not g.is_contiguous():
            return None
        storage = g.untyped_storage()
        return storage if storage.nbytes() == g.nbytes else None


class KeepAllAtOnce:
    """``kept[i].keep_all(params[i])`` for every ``i`` at once (``__call__``), if each would keep all (else False,
    nothing changed): every ``.grad`` exists and owns its storage whole, and none is kept yet. One ledger entry per
    group, made in one section (the groups share one ledger). What does not change between backwards (the parameters
    in one list, their sizes, where each group's begin) is laid out once, when made: one rank's backward schedule
    makes one for the groups it takes at the end.

    The test is one list comparison: each gradient's storage holds exactly its parameter's elements in the group's
    dtype (``_sizes``). torch holds a ``.grad`` to its parameter's shape and dtype, so a storage of that many bytes is
    the gradient's alone (a view of a larger tensor has a larger storage), read by torch's own methods mapped over the
    list: no Python frame per gradient, and no pass for what torch guarantees. (Its layout is not asked: the step,
    the norm and a move into the flat buffer read any strides.)"""

    def __init__(self, kept: list[KeptGrads], params: list[list[torch.nn.Parameter]]) -> None:
        self._kept, self._params = kept, params
        self._flat = list(chain.from_iterable(params))
        self._sizes = list(chain.from_iterable(k._sizes for k in kept))
        ends = list(accumulate(map(len, params)))
        self._bounds = list(zip([0] + ends[:-1], ends))
        self._totals = [k._total for k in kept]

    def __call__(self) -> bool:
        kept = self._kept
        if not kept or any([k.holds() for k in kept]):
            return False
        grads = list(map(_GRAD, self._flat))
        if any(map(is_, grads, repeat(None))):
            return False
        if list(map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, grads))) != self._sizes:
            return False
        taken = [grads[a:b] for a, b in self._bounds]
        keys = kept[0]._ledger.count_each(list(zip(taken, self._totals)), Category.GRAD)
        for k, ps, t, key in zip(kept, self._params, taken, keys):
            k._took(t, ps, key)  # type: ignore[arg-type]
        return True
