"""Which of one flat group's gradients have arrived in this backward, and by which route.

A parameter's gradient reaches its group's flat buffer by one of three routes: its gradient hook (counted here,
``seen``), its uses (``use_grads.py``: a parameter used outside its holders, or an embedding, sends each use's
gradient itself, ``route_per_use``; such a parameter is not counted, and the group waits for the dense uses made in
the forward to come back, ``dense_uses_back``), or rows (an embedding's per-token sums kept at stages 2-3 for the
sparse reduction, ``keep_rows``/``take_rows``; or a gradient added by row slices, ``arrived_by_rows``, which its
hook then finds with ``came_by_rows``). ``ZeroPartition`` asks ``all_counted`` and ``dense_uses_back`` to decide
when a group may reduce; ``end_backward`` forgets everything but the routes.

State only (sets and counters over the group's parameter indices): the gradient values are the group's.
The invariant: ``all_counted`` is true exactly when every parameter not routed per use has had its hook run since
the count last restarted. Tests: ``tests/zero/test_use_grads.py``, ``tests/zero/test_one_rank.py``,
``tests/zero/test_parity.py`` (tied weights, a parameter used twice, embeddings at every stage).
"""
from __future__ import annotations

import torch

Rows = list[tuple[torch.Tensor, torch.Tensor, int]]  # (ids, sums, tokens) per use


class GradArrival:
    def __init__(self, count: int) -> None:
        """``count``: the group's parameters."""
        self.count = count
        self.per_use: set[int] = set()  # parameters whose uses send their gradients: not counted
        self.row_params: set[int] = set()  # of those, the ones an embedding sends rows for
        self.rows: dict[int, Rows] = {}  # stages 2-3: each row parameter's kept per-token sums
        self.rows_dense = False  # stages 2-3: rows go into the flat buffer instead (``row_reduce.choose_dense``)
        self._seen = 0  # counted parameters whose gradient hook ran
        self._dense_pending = 0  # dense uses of per-use parameters made in the forward, not yet back
        self._by_rows: set[int] = set()  # parameters whose gradient came by rows, their hook not yet run

    # -- routes (set once, when the partition installs its hooks) --------------------------------
    def route_per_use(self, index: int, by_rows: bool) -> None:
        """Parameter ``index``'s uses send its gradient, by rows if ``by_rows`` (an embedding): not counted."""
        self.per_use.add(index)
        if by_rows:
            self.row_params.add(index)

    def routed(self, index: int) -> bool:
        return index in self.per_use

    # -- one backward -------------------------------------------------------------------------------
    def seen(self, index: int | None = None) -> None:
        """A gradient hook ran: parameter ``index`` counted unless its uses send it; None: every parameter."""
        if index is None:
            self._seen += self.count
        elif index not in self.per_use:
            self._seen += 1

    def dense_use_made(self) -> None:
        """Forward: a holder of one of the per-use parameters ran; one more dense gradient to wait for."""
        self._dense_pending += 1

    def dense_use_back(self) -> None:
        self._dense_pending -= 1

    def keep_rows(self, index: int, ids: torch.Tensor, sums: torch.Tensor, tokens: int) -> None:
        """Stages 2-3: an embedding's per-token sums for parameter ``index``, kept for the sparse reduction."""
        self.rows.setdefault(index, []).append((ids, sums, tokens))

    def take_rows(self) -> dict[int, Rows]:
        """The rows kept in this backward, handed over for their reduction (``row_reduce.py``)."""
        rows, self.rows = self.rows, {}
        return rows

    def arrived_by_rows(self, index: int) -> None:
        """Parameter ``index``'s gradient went into the flat buffer by row slices (its last one is in)."""
        self._by_rows.add(index)

    def any_by_rows(self) -> bool:
        return bool(self._by_rows)

    def came_by_rows(self, index: int, clear: bool = True) -> bool:
        """Whether parameter ``index``'s gradient went into the flat buffer by rows since its hook last ran
        (asked once, by the hook, which clears it; ``clear=False`` only asks)."""
        by_rows = index in self._by_rows
        if clear:
            self._by_rows.discard(index)
        return by_rows

    def all_counted(self) -> bool:
        """Every counted parameter's gradient hook ran (per-use parameters are not counted)."""
        return self._seen == self.count - len(self.per_use)

    def dense_uses_back(self) -> bool:
        """Every dense use made in the forward has delivered its gradient."""
        return self._dense_pending <= 0

    def restart_count(self) -> None:
        """Reduced (or left for the boundary), or the gradients freed: count the next gradients from zero."""
        self._seen = 0

    def end_backward(self) -> None:
        """The backward is over: nothing is counted, awaited or unclaimed any more."""
        self._seen = 0
        self._dense_pending = 0
        self._by_rows.clear()
