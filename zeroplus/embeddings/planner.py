"""Choosing each table's sharding: fit a per-rank byte budget, balance bytes and lookups over the ranks.

    tables = plan_tables(tables, world=8, optimizer=SparseOptimConfig("rowwise_adagrad"),
                         per_rank_bytes=12 * 2**30, lookups={"c3": 20.0}).tables

A table's cost is its weights and its optimizer state (``rows x dim x 4`` plus ``sparse_optim.state_bytes``),
and its lookups per sample (``lookups``: mean ids per bag, 1 where not given). Tables given a sharding keep it
(``"auto"`` ones are planned), largest first:

- **table-wise** onto the rank with the least load, when that rank's bytes with the whole table stay within an
  even share of all tables' bytes (``total / world``) or the fullest rank's so far, 5% over allowed, and fit its
  remaining budget (row-wise tables cost a ``world B x dim`` reduce-scatter per lookup, whole ones do not).
  Load: the rank's fraction of all bytes plus its fraction of all lookups, so hot small tables spread as
  large ones do. One holder per id.
- **row-wise** otherwise: ``ceil(rows / world)`` rows on every rank (rank 0 the fullest), each id to one holder,
  its lookups spread (evenly, ids assumed uniform over rows; power-law ids weigh on rank 0).

Column-wise is never chosen (for the narrow tables of DLRM it sends every id to every column holder), only
kept where given. A table that fits nowhere is refused, naming the table, its bytes, each rank's share and
room, and what would fit it: the world size whose plan fits, or the per-rank budget this world needs.
The budget covers the tables alone: the dense part's ZeRO shards, the routing buffers (``collection.py``) and
activations come on top (``zeroplus.estimate`` predicts them all).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from .sparse_optim import SparseOptimConfig, state_bytes
from .tables import TableConfig, shard

SLACK = 1.05  # table-wise may leave a rank this much above the level (small tables stay whole: less traffic)


@dataclass(frozen=True)
class TablePlan:
    """The planned tables (every ``sharding`` set; table-wise ones with their ``owner``), and per rank the
    table bytes (weights and states) and lookups per sample it holds."""
    tables: list[TableConfig]
    bytes_per_rank: list[int]
    lookups_per_rank: list[float]

    def describe(self) -> str:
        kinds = {k: [t.name for t in self.tables if t.sharding == k] for k in ("table", "row", "column")}
        parts = [f"{k}-wise: {', '.join(v)}" for k, v in kinds.items() if v]
        per_rank = ", ".join(f"rank {r} {b / 2**20:.1f} MiB" for r, b in enumerate(self.bytes_per_rank))
        return f"{'; '.join(parts)} ({per_rank})"


class TablePlanError(ValueError):
    """No sharding fits a table in the budget."""


def table_bytes(t: TableConfig, optimizer: SparseOptimConfig, world: int, rank: int, owner: int = 0) -> int:
    """Weights and optimizer state of ``t`` on ``rank`` under its sharding."""
    s = shard(t, world, rank, owner)
    return s.rows * s.cols * 4 + state_bytes(optimizer, s.rows, s.cols)


def _place(tables: Sequence[TableConfig], world: int, optimizer: SparseOptimConfig, budget: int | None,
           lookups: Mapping[str, float]) -> TablePlan:
    load = [0] * world
    hits = [0.0] * world
    whole = {t.name: table_bytes(dataclasses.replace(t, sharding="table", owner=0), optimizer, 1, 0) for t in tables}
    total_bytes = max(1, sum(whole.values()))
    total_hits = max(1e-9, sum(lookups.get(t.name, 1.0) for t in tables))
    planned: dict[str, TableConfig] = {}
    fixed = [t for t in tables if t.sharding != "auto"]
    auto = sorted((t for t in tables if t.sharding == "auto"), key=lambda t: -whole[t.name])
    for t in [*fixed, *auto]:
        hit = lookups.get(t.name, 1.0)
        if t.sharding == "auto":
            r = min(range(world), key=lambda r: load[r] / total_bytes + hits[r] / total_hits)
            room = None if budget is None else budget - load[r]
            level = SLACK * max(total_bytes / world, max(load))  # an even share, or the fullest rank already
            if load[r] + whole[t.name] <= level and (room is None or whole[t.name] <= room):
                t = dataclasses.replace(t, sharding="table", owner=r)
            else:
                t = dataclasses.replace(t, sharding="row", owner=None)
        owner = t.owner if t.owner is not None else (min(range(world), key=lambda r: load[r])
                                                     if t.sharding == "table" else 0)
        if t.sharding == "table":
            t = dataclasses.replace(t, owner=owner)
        shares = [table_bytes(t, optimizer, world, r, owner) for r in range(world)]
        if budget is not None and any(load[r] + shares[r] > budget for r in range(world)):
            worst = max(range(world), key=lambda r: load[r] + shares[r] - budget)
            raise TablePlanError(
                f"table {t.name!r} ({whole[t.name]:,} bytes with its {optimizer.type} state) does not fit a budget "
                f"of {budget:,} bytes per rank: {t.sharding}-wise it puts {shares[worst]:,} bytes on rank {worst}, "
                f"which has {max(0, budget - load[worst]):,} left")
        for r in range(world):
            load[r] += shares[r]
            if shares[r]:
                hits[r] += hit * (shares[r] / max(1, sum(shares)) if t.sharding == "row" else 1.0)
        planned[t.name] = t
    return TablePlan([planned[t.name] for t in tables], load, hits)


def plan_tables(tables: Sequence[TableConfig], world: int, optimizer: SparseOptimConfig | None = None, *,
                per_rank_bytes: int | None = None, lookups: Mapping[str, float] | None = None) -> TablePlan:
    """Every ``"auto"`` table given a sharding over ``world`` ranks (module docstring); ``TablePlanError``
    when no sharding fits ``per_rank_bytes``, saying what would."""
    optimizer = optimizer or SparseOptimConfig()
    lookups = dict(lookups or {})
    unknown = sorted(set(lookups) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"plan_tables: lookups name tables {unknown} that are not among the tables")
    try:
        return _place(tables, world, optimizer, per_rank_bytes, lookups)
    except TablePlanError as err:
        unbounded = _place(tables, world, optimizer, None, lookups)
        fits = next((w for w in range(world + 1, 64 * world + 1)
                     if max(_place(tables, w, optimizer, None, lookups).bytes_per_rank) <= (per_rank_bytes or 0)), None)
        more = f"{fits} ranks" if fits is not None else f"more than {64 * world} ranks"
        raise TablePlanError(f"{err}; it fits with {more} at this budget, or with {max(unbounded.bytes_per_rank):,} "
                             f"bytes per rank on {world} ranks" + _smaller_state(optimizer)) from None


def _smaller_state(optimizer: SparseOptimConfig) -> str:
    if optimizer.type in ("adagrad", "adam"):
        return ", or with a smaller optimizer state (rowwise_adagrad: 4 bytes per row)"
    return ""


__all__ = ["TablePlan", "TablePlanError", "plan_tables", "table_bytes"]
