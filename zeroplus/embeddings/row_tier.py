"""Tables of a collection whose shards live on a tier (``TableConfig.cache_rows``): their ``RowCache`` made, and
the collection's buffer and optimizer pointed at the cache's slots.

``cached_tables(ebc, tier)`` moves each such table's shard and optimizer states (built whole in memory first, as
every shard is) onto the tier and keeps ``cache_rows`` rows of them in memory; the shard's buffer
(``weight__<table>``) and the optimizer's ``weight`` and ``state`` then are the slots, so the ledger, the pooling
and the optimizer see the cache as they see a resident shard, indexed by slot instead of row. A rank holding
nothing of a table has no cache for it. Refused (``ValueError``, naming the tables): a cache without a tier, and
a cache on a column-wise table (every column holder would cache the row apart; its row-wise Adagrad pairs
the holders' rows by order, which separate caches do not keep).
"""
from __future__ import annotations

from ..accelerator import get_accelerator
from ..ledger import Ledger
from ..offload.tiers import make_tier
from .row_cache import RowCache
from .table_values import TableValues
from .tables import TableTier


def cached_tables(ebc: TableValues, tier: TableTier | None) -> dict[str, RowCache]:
    wanted = [t for t in ebc.tables if t.cache_rows is not None]
    if not wanted:
        return {}
    names = [t.name for t in wanted]
    column = [t.name for t in wanted if t.sharding == "column"]
    if column:
        raise ValueError(f"tables {column}: cache_rows needs table- or row-wise sharding (each column holder would "
                         f"cache the rows apart)")
    meta = ebc.device.type == "meta"
    if tier is None and not meta:
        raise ValueError(f"tables {names} set cache_rows and the collection has no tier: give "
                         f"EmbeddingBagCollection(..., tier=TableTier('file', path)) or TableTier('host')")
    made = None if meta or tier is None else make_tier(tier.kind, tier.path, get_accelerator(), Ledger(),
                                                         label="tables")
    caches = {}
    for t in wanted:
        s = ebc.mine(t.name)
        if s.empty:
            continue
        initial = {"weight": ebc.weight(t.name), **ebc.optimizers[t.name].state}
        widths = {k: v.shape[1] if v.dim() == 2 else 1 for k, v in initial.items()}
        caches[t.name] = RowCache(s.rows, widths, t.cache_rows or 1, made, initial, t.name)
        attach(ebc, t.name, caches[t.name])
    return caches


def attach(ebc: TableValues, name: str, cache: RowCache) -> None:
    """Table ``name``'s buffer and optimizer pointed at ``cache``'s slots."""
    setattr(ebc, f"weight__{name}", cache.slots["weight"])
    optimizer = ebc.optimizers[name]
    optimizer.weight = cache.slots["weight"]
    optimizer.state = {k: cache.slots[k] for k in optimizer.state}


__all__ = ["attach", "cached_tables"]
