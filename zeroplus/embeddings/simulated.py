"""An ``EmbeddingBagCollection`` on the meta device: the lookup's memory without its values (the estimate).

The memory estimate (``zeroplus/budget``) runs the engine on the meta device, where no id has a value and no
collective moves anything, so the route cannot count what each rank sends. ``simulated_route`` stands in for
it with the shapes alone, assuming every rank sends what this rank sends and row-wise ids fall evenly over
the row holders. For a table whose ``n`` ids this rank looks up (``W`` ranks):

- sent: ``n`` ids (row-wise: spread over the holders), ``n`` per column holder (column-wise), ``n`` to the
  owner (table-wise); received: ``n`` (row-wise), ``W n`` on a column holder or the owner, else none;
- each id sent or received holds 8 (row or id) + 8 (bag) + 4 (weight) bytes while routed; the received ids of
  every table are kept for the backward (``routed.py``).

The pooling and the backward then run the collection's own code on meta tensors (their buffers are the
real ones' shapes), except where a size depends on values: ``unique_rows`` takes every routed id as distinct
(at most the shard's rows), an upper bound on the pending row gradients (``k x cols`` fp32 and ``k`` int64
until the step). With power-law ids the real pending rows are fewer, and row-wise rank 0 receives more.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .routed import Bag, LookupState, Routed
from .table_values import TableValues


def received_ids(ebc: TableValues, name: str, sent_by_each: int) -> int:
    """Ids of table ``name`` this rank receives when every rank sends ``sent_by_each`` of them."""
    t, s = next(t for t in ebc.tables if t.name == name), ebc.mine(name)
    if t.sharding == "row":
        return sent_by_each if not s.empty else 0
    return ebc.world * sent_by_each if not s.empty else 0


def sent_ids(ebc: TableValues, name: str, looked_up: int) -> int:
    """Ids of table ``name`` this rank sends for its ``looked_up`` ones (column-wise: one per holder)."""
    t = next(t for t in ebc.tables if t.name == name)
    if t.sharding == "column":
        return looked_up * sum(1 for s in ebc.shards[name] if not s.empty)
    return looked_up


def simulated_route(ebc: TableValues, features: Mapping[str, Bag]) -> LookupState:
    """The route's buffers and what it keeps, by shape (module docstring); no collective runs."""
    meta = torch.device("meta")
    batch = next(iter(features.values()))[1].numel()
    step = LookupState(batch)
    sent = received = 0
    for t in ebc.tables:
        bag = features[t.name]
        ids, weighted = bag[0], len(bag) > 2 and bag[2] is not None
        n = ids.numel()
        sent += sent_ids(ebc, t.name, n)
        got = received_ids(ebc, t.name, n)
        received += got
        # zeros, not empty: the estimate may run index operations on the values it knows (row 0, bag 0: valid)
        step.routed[t.name] = Routed(torch.zeros(got, dtype=torch.long, device=meta),
                                     torch.zeros(got, dtype=torch.long, device=meta),
                                     torch.ones(got, device=meta) if weighted else None)
        if t.sharding == "row" and t.pooling == "mean":
            step.lengths[t.name] = torch.ones(batch, dtype=torch.long, device=meta)
    # the streams in flight: sent (ids, bags, weights) and received before they are split per table
    in_flight = [torch.empty(k, dtype=dtype, device=meta) for k in (sent, received)
                 for dtype in (torch.long, torch.long, torch.float32)]
    del in_flight
    return step


def unique_rows(rows: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(rows, return_inverse=True)``; on the meta device every row distinct, at most ``limit``."""
    if not rows.is_meta:
        return torch.unique(rows, return_inverse=True)
    return rows[:min(rows.numel(), limit)], rows


__all__ = ["received_ids", "sent_ids", "simulated_route", "unique_rows"]
