"""A table collection's values as checkpoints, export and tests read and write them, shard by shard.

``TableValues`` is ``EmbeddingBagCollection``'s base class: reading the state the collection owns (its tables,
each rank's shards, the sparse optimizers' states, the row caches of tables on a tier), it gives the whole table
or an optimizer state assembled from every rank's shard (``full_table``: a collective, and it holds a whole
table, so for tests and export only), this rank's shard and states as live tensors or, for a cached table,
copies read from its tier (``shard_values``), written back after a change (``replace_shard``), and a whole
table's rows loaded into this rank's shard (``load_table``). No rank holds a table it does not own outside
``full_table``. See note: sparse tables (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any

import torch

from .tables import Shard, TableConfig


class TableValues:
    """The values half of ``EmbeddingBagCollection``: what it holds, read and written by name."""

    tables: list[TableConfig]
    shards: dict[str, list[Shard]]
    optimizers: dict[str, Any]
    caches: dict[str, Any]
    group: Any
    rank: int
    world: int

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def mine(self, name: str) -> Shard:
        raise NotImplementedError

    def weight(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def full_table(self, name: str, state: str | None = None) -> torch.Tensor:
        """The whole table (or its optimizer state ``state``: ``"sum"``, ``"exp_avg"``, ...) assembled from every
        rank's shard (a collective; for tests and export: it holds a whole table)."""
        t = next(t for t in self.tables if t.name == name)
        cache, key = self.caches.get(name), "weight" if state is None else state
        if cache is not None:  # only the component asked for read from the tier
            mine = cache.whole(key)
        else:
            mine = self.weight(name) if state is None else self.optimizers[name].state[state]
        pieces = self.group.all_gather_objects(mine.detach().cpu().clone())
        per_row = pieces[self.rank].dim() == 1  # row-wise Adagrad's state: one value per row
        full = torch.zeros(t.num_embeddings) if per_row else torch.zeros(t.num_embeddings, t.dim)
        for s, piece in zip(self.shards[name], pieces):
            if s.empty:
                continue
            if per_row:
                full[s.row0:s.row1] = piece
            else:
                full[s.row0:s.row1, s.col0:s.col1] = piece
        return full

    @torch.no_grad()
    def load_table(self, name: str, full: torch.Tensor) -> None:
        """This rank's shard of ``full`` (the whole table, on every rank) copied in."""
        s = self.mine(name)
        weight, states = self.shard_values(name)
        weight.copy_(full[s.row0:s.row1, s.col0:s.col1])
        self.replace_shard(name, weight, states)

    def shard_values(self, name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's whole shard of table ``name`` and its optimizer states: the live tensors, or for a cached
        table copies read from its tier (written back by ``replace_shard``)."""
        cache = self.caches.get(name)
        if cache is None:
            return self.weight(name), self.optimizers[name].state
        return cache.whole("weight"), {k: cache.whole(k) for k in self.optimizers[name].state}

    def replace_shard(self, name: str, weight: torch.Tensor, states: dict[str, torch.Tensor]) -> None:
        """After ``shard_values``' tensors were changed: a cached table's tier rewritten (else nothing to do)."""
        if name in self.caches:
            self.caches[name].replace({"weight": weight, **states})
