"""Embedding tables and how each is split over the data-parallel ranks (DLRM-style sharding).

``TableConfig(name, num_embeddings, dim, pooling, sharding)`` describes one ``EmbeddingBag``-like table;
``shard(table, world, rank)`` says what rank ``rank`` holds of it:

- ``"table"`` (table-wise): the whole table on one rank (``owner``, given or chosen round-robin by the
  collection), nothing elsewhere. Bytes per rank: ``num_embeddings * dim * 4`` on the owner, 0 elsewhere.
- ``"row"`` (row-wise): rows ``[r0, r1)``, contiguous, ``ceil(num_embeddings / world)`` per rank (the last
  rank fewer). Bytes: ``(r1 - r0) * dim * 4``.
- ``"column"`` (column-wise): columns ``[c0, c1)`` of every row, ``ceil(dim / world)`` per rank (the last
  fewer; a rank past ``dim`` holds none). Bytes: ``num_embeddings * (c1 - c0) * 4``.

``"auto"``: the collection asks ``planner.plan_tables`` (table-wise for small tables, row-wise for large).

``cache_rows``: the table's shard lives on the collection's tier (``TableTier``: host memory or files), its
``cache_rows`` most recently used rows in memory (``row_cache.py``); table- and row-wise tables only.

Table-wise is column-wise with every column on one rank, and the collection runs both through the same
route (``collection.py``). Optimizer states add per rank: Adagrad ``rows x cols x 4``, row-wise Adagrad
``rows x 4``, Adam ``2 x rows x cols x 4`` (``sparse_optim.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

POOLINGS = ("sum", "mean")
SHARDINGS = ("table", "row", "column", "auto")


@dataclass(frozen=True)
class TableConfig:
    """One table: ``num_embeddings`` rows of ``dim`` fp32 values, pooled per bag by ``pooling``."""
    name: str
    num_embeddings: int
    dim: int
    pooling: Literal["sum", "mean"] = "sum"
    sharding: Literal["table", "row", "column", "auto"] = "table"  # auto: planner.py chooses
    owner: int | None = None  # table-wise: the rank holding it (None: the collection chooses)
    cache_rows: int | None = None  # the shard on the collection's tier, this many hot rows in memory (row_cache.py)

    def __post_init__(self) -> None:
        if self.num_embeddings < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: num_embeddings and dim must be positive, got "
                             f"{self.num_embeddings} x {self.dim}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.cache_rows is not None and self.cache_rows < 1:
            raise ValueError(f"table {self.name!r}: cache_rows must be at least 1 (or None: no cache), got "
                             f"{self.cache_rows}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"table {self.name!r}: sharding must be one of {SHARDINGS}, got {self.sharding!r}")


@dataclass(frozen=True)
class TableTier:
    """Where the shards of tables with ``cache_rows`` live: pinned host memory, or files under ``path``."""
    kind: Literal["host", "file"] = "file"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("host", "file"):
            raise ValueError(f"table tier kind must be 'host' or 'file', got {self.kind!r}")
        if self.kind == "file" and not self.path:
            raise ValueError("a file table tier needs a directory path (TableTier('file', path))")


@dataclass(frozen=True)
class Shard:
    """Rows ``[row0, row1)`` and columns ``[col0, col1)`` of a table held by one rank (may be empty)."""
    row0: int
    row1: int
    col0: int
    col1: int

    @property
    def rows(self) -> int:
        return self.row1 - self.row0

    @property
    def cols(self) -> int:
        return self.col1 - self.col0

    @property
    def empty(self) -> bool:
        return self.rows == 0 or self.cols == 0


def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    per = math.ceil(n / world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def shard(table: TableConfig, world: int, rank: int, owner: int = 0) -> Shard:
    """What ``rank`` of ``world`` holds of ``table`` (``owner``: the table-wise owner)."""
    n, d = table.num_embeddings, table.dim
    if table.sharding == "row":
        return Shard(*_split(n, world, rank), 0, d)
    if table.sharding == "column":
        return Shard(0, n, *_split(d, world, rank))
    return Shard(0, n, 0, d) if rank == owner else Shard(0, n, 0, 0)


def shard_bytes(table: TableConfig, world: int, rank: int, owner: int = 0, element_bytes: int = 4) -> int:
    """The table's bytes on ``rank`` (weights only)."""
    s = shard(table, world, rank, owner)
    return s.rows * s.cols * element_bytes


__all__ = ["POOLINGS", "SHARDINGS", "Shard", "TableConfig", "TableTier", "shard", "shard_bytes"]
