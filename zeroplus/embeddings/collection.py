"""Many pooled embedding tables sharded over the data-parallel ranks; lookups routed by all-to-all.

``EmbeddingBagCollection(tables, optimizer, group)`` holds, on each rank, its shard of every table
(``tables.py``): whole tables (table-wise), row ranges (row-wise) or column ranges (column-wise). No rank
ever holds or gathers a whole table it does not own. ``forward(features)`` takes this rank's batch, per
table ``(ids, offsets)`` or ``(ids, offsets, per_sample_weights)`` as ``nn.EmbeddingBag`` does (``offsets``
the ``B`` bag starts, the same ``B`` on every rank), and returns the pooled ``(B, sum of dims)`` in table
order. Per forward:

1. one all-to-all of counts, then one of ids, their bag (``source rank * B + bag``) and weights: each id to
   the ranks that hold its row (row-wise: one; column-wise: every rank holding columns; table-wise: the owner);
2. the holders pool: column and table shards with ``F.embedding_bag`` over every rank's bags (the same
   ids in the same order as one process: the same values), row shards by adding their rows into
   ``(world B, dim)`` partial sums;
3. one all-to-all brings the column/table blocks back to each bag's rank (columns concatenated in rank
   order); one reduce-scatter sums the row-wise partials onto it (mean: divided by the bag's length there).

Backward runs the exchange in reverse (the pooled gradients to the holders: all-to-all; all-gather for
row-wise), and each holder sums its rows' gradients over duplicates and ranks into ``(unique rows, cols)``,
divided by the world size (the dense part is averaged over ranks, so the tables are too: the run equals one
process over the global batch). They wait, sparse, until ``step()`` applies them with the row-sparse
optimizer (``sparse_optim.py``); micro-batches before a step accumulate. No gradient of a table's size
exists, and the tables are not parameters (``requires_grad`` is off; the engine's optimizer never sees them).

Memory per rank: the shards (``tables.shard_bytes``), their optimizer states (``sparse_optim.state_bytes``),
and per step the routed ids (8 + 8 + 4 bytes per id sent and received), the holders' pooled blocks
(``world B x cols`` per column/table shard and ``world B x dim`` per row-wise table, fp32) and the pending
row gradients (``unique rows x cols``). Communication per forward: the ids (20 bytes each, once per holder),
the pooled blocks (``B x cols`` to each rank) and ``world B x dim`` reduce-scattered per row-wise table; the
same again in backward. See note: sparse tables (docs/design-notes.md).
"""
from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..collectives import Collectives
from ..comm import DataParallelGroup
from ..parallel.groups import current_groups
from .planner import plan_tables
from .routed import Bag, LookupState, Routed
from .row_tier import attach, cached_tables
from .simulated import simulated_route, unique_rows
from .sparse_optim import SparseOptimConfig, SparseOptimizer
from .table_values import TableValues
from .tables import Shard, TableConfig, TableTier, shard


def table_owners(tables: Sequence[TableConfig], world: int) -> dict[str, int]:
    """Table-wise owners: a table's own ``owner``, else the rank holding the fewest table-wise bytes so far,
    largest tables first (the same answer on every rank)."""
    load = [0] * world
    owners: dict[str, int] = {}
    for t in tables:
        if t.sharding == "table" and t.owner is not None:
            if not 0 <= t.owner < world:
                raise ValueError(f"table {t.name!r}: owner {t.owner} is not a rank of a group of {world}")
            owners[t.name] = t.owner
            load[t.owner] += t.num_embeddings * t.dim
    for t in sorted((t for t in tables if t.sharding == "table" and t.owner is None),
                    key=lambda t: -t.num_embeddings * t.dim):
        owners[t.name] = min(range(world), key=lambda r: load[r])
        load[owners[t.name]] += t.num_embeddings * t.dim
    return owners


class EmbeddingBagCollection(TableValues, nn.Module):
    def __init__(self, tables: Sequence[TableConfig], optimizer: SparseOptimConfig | None = None,
                 group: Collectives | None = None, seed: int = 0, tier: TableTier | None = None) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"EmbeddingBagCollection needs tables with distinct names, got {names}")
        self.optim_config = optimizer or SparseOptimConfig()
        if group is None:  # the data-parallel ranks: init_parallel's (the estimate's stand-ins), else the world
            current = current_groups()
            group = current.data if current is not None else DataParallelGroup(None)
        self.group = group
        self.world, self.rank = self.group.size, self.group.rank
        self.tables = list(tables)
        if any(t.sharding == "auto" for t in tables):  # chosen by the planner, which then places every table
            self.tables = plan_tables(tables, self.world, self.optim_config).tables
        owners = table_owners(self.tables, self.world)
        self.owners = owners
        self.shards: dict[str, list[Shard]] = {
            t.name: [shard(t, self.world, r, owners.get(t.name, 0)) for r in range(self.world)] for t in self.tables}
        g = torch.Generator().manual_seed(seed + 1000 * self.rank)
        for t in self.tables:
            s = self.mine(t.name)
            weight = torch.empty(s.rows, s.cols).uniform_(-t.num_embeddings ** -0.5, t.num_embeddings ** -0.5,
                                                          generator=g) if not s.empty else torch.empty(s.rows, s.cols)
            self.register_buffer(f"weight__{t.name}", weight)
        self.optimizers = {t.name: SparseOptimizer(self.optim_config, self.weight(t.name)) for t in self.tables}
        self.caches = cached_tables(self, tier)  # tables with cache_rows: moved to the tier, hot rows kept
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {t.name: [] for t in self.tables}

    @property
    def device(self) -> torch.device:
        """Where the shards are (``to_device`` moves them; the engine does at ``initialize``)."""
        return self.weight(self.tables[0].name).device

    def to_device(self, device: torch.device | str) -> None:
        """The shards and their optimizer states moved to ``device``, fp32 kept (the engine's placement calls
        this instead of moving and casting the buffers as it does a dense model's); a cached table's slots."""
        for cache in self.caches.values():
            cache.to(device)
        for t in self.tables:
            if t.name in self.caches:
                attach(self, t.name, self.caches[t.name])
                continue
            moved = self.weight(t.name).to(device)
            setattr(self, f"weight__{t.name}", moved)
            optimizer = self.optimizers[t.name]
            optimizer.weight = moved
            optimizer.state = {k: v.to(device) for k, v in optimizer.state.items()}

    def mine(self, name: str) -> Shard:
        return self.shards[name][self.rank]

    def weight(self, name: str) -> torch.Tensor:
        """This rank's shard of table ``name`` (rows x cols of ``mine(name)``)."""
        return getattr(self, f"weight__{name}")

    # --- input: every id to its holders -------------------------------------------------------------------
    def _check(self, t: TableConfig, bag: Bag) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, offsets = bag[0], bag[1]
        weights = bag[2] if len(bag) > 2 else None
        if ids.dim() != 1 or offsets.dim() != 1:
            raise ValueError(f"table {t.name!r} on rank {self.rank}: ids and offsets must be 1-D, got "
                             f"{tuple(ids.shape)} and {tuple(offsets.shape)}")
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= t.num_embeddings:
                bad = low if low < 0 else high
                raise ValueError(f"table {t.name!r} on rank {self.rank}: id {bad} is outside its "
                                 f"{t.num_embeddings} rows")
        if weights is not None:
            if t.pooling != "sum":
                raise ValueError(f"table {t.name!r} on rank {self.rank}: per-sample weights need sum pooling "
                                 f"(as nn.EmbeddingBag), the table pools by {t.pooling!r}")
            if weights.shape != ids.shape:
                raise ValueError(f"table {t.name!r} on rank {self.rank}: per_sample_weights {tuple(weights.shape)}"
                                 f" for ids {tuple(ids.shape)}")
        return ids.long(), offsets.long(), weights

    def _holders(self, t: TableConfig, ids: torch.Tensor) -> list[torch.Tensor]:
        """Per rank, a mask (or index) of the ids it must receive."""
        spans = self.shards[t.name]
        if t.sharding == "row":
            return [(ids >= s.row0) & (ids < s.row1) for s in spans]
        return [torch.ones_like(ids, dtype=torch.bool) if not s.empty else torch.zeros_like(ids, dtype=torch.bool)
                for s in spans]

    def _prepare(self, features: Mapping[str, Bag]) -> tuple[dict, int, list, torch.Tensor]:
        """Per table this rank's bag lengths, its batch, what goes to each rank, and the counts (may raise)."""
        missing = [t.name for t in self.tables if t.name not in features]
        extra = sorted(set(features) - {t.name for t in self.tables})
        if missing or extra:
            raise ValueError(f"EmbeddingBagCollection on rank {self.rank}: features for tables {missing} are "
                             f"missing" + (f", {extra} are not tables" if extra else ""))
        T, W = len(self.tables), self.world
        checked = {t.name: self._check(t, features[t.name]) for t in self.tables}
        lengths_of = {}
        batches = {name: c[1].numel() for name, c in checked.items()}
        batch = next(iter(batches.values()))
        if any(b != batch for b in batches.values()):
            raise ValueError(f"EmbeddingBagCollection on rank {self.rank}: every table needs the same number of "
                             f"bags, got {batches}")
        send: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in range(W)]
        # per destination: ids per table, then this rank's batch, its weighted-table mask, an error flag
        counts = torch.zeros(W, T + 3, dtype=torch.long, device=self.device)
        for j, t in enumerate(self.tables):
            ids, offsets, weights = checked[t.name]
            lengths = torch.diff(offsets, append=torch.tensor([ids.numel()], device=self.device))
            if (lengths < 0).any() or (offsets.numel() and offsets[0] != 0):
                raise ValueError(f"table {t.name!r} on rank {self.rank}: offsets must start at 0, not decrease and"
                                 f" not pass the {ids.numel()} ids, got {offsets.tolist()[:8]}")
            lengths_of[t.name] = lengths
            bags = torch.repeat_interleave(torch.arange(batch, device=self.device) + self.rank * batch, lengths)
            w = weights.float() if weights is not None else torch.ones(ids.numel(), device=self.device)
            for dest, mask in enumerate(self._holders(t, ids)):
                send[dest].append((ids[mask], bags[mask], w[mask]))
                counts[dest, j] = int(mask.sum())
        counts[:, T] = batch
        counts[:, T + 1] = sum(int(checked[t.name][2] is not None) << j for j, t in enumerate(self.tables))
        return lengths_of, batch, send, counts

    def _route(self, features: Mapping[str, Bag]) -> LookupState:
        """Every id to the ranks holding its row or columns. Bad input on any rank raises on every rank (the
        count exchange carries an error flag; the messages are then gathered), so no rank waits alone."""
        T, W = len(self.tables), self.world
        try:
            lengths_of, batch, send, counts = self._prepare(features)
            problem = ""
        except ValueError as err:
            problem, counts = str(err), torch.zeros(W, T + 3, dtype=torch.long, device=self.device)
            counts[:, T + 2] = 1
        got = torch.empty_like(counts)
        self.group.all_to_all(got.view(-1), counts.view(-1)).wait()
        if got[:, T + 2].any() or problem:
            problems = self.group.all_gather_objects(problem) if W > 1 else [problem]
            raise ValueError("; ".join(p for p in problems if p))
        if (got[:, T] != batch).any() or (got[:, T + 1] != counts[0, T + 1]).any():
            raise ValueError(f"EmbeddingBagCollection on rank {self.rank}: every rank needs the same batch and the "
                             f"same tables weighted; bags per rank {got[:, T].tolist()}, weighted-table masks "
                             f"{got[:, T + 1].tolist()} (bit j: table j)")
        weighted = [bool(int(counts[0, T + 1]) >> j & 1) for j in range(T)]
        in_sizes = [int(counts[d, :T].sum()) for d in range(W)]
        out_sizes = [int(got[s, :T].sum()) for s in range(W)]
        ids_out, bags_out, w_out = (torch.cat([torch.cat([x[k] for x in send[d]]) for d in range(W)]) for k in range(3))
        ids_in = torch.empty(sum(out_sizes), dtype=torch.long, device=self.device)
        bags_in = torch.empty(sum(out_sizes), dtype=torch.long, device=self.device)
        w_in = torch.empty(sum(out_sizes), device=self.device)
        for out, inp in ((ids_in, ids_out), (bags_in, bags_out), (w_in, w_out)):
            self.group.all_to_all_v(out, inp, out_sizes, in_sizes)
        step = LookupState(batch)
        # split what came in: source-major, table-minor
        per_source = [got[s, :T].tolist() for s in range(W)]
        starts = [0, *itertools.accumulate(out_sizes)]
        for j, t in enumerate(self.tables):
            pieces = []
            for s in range(W):
                begin = starts[s] + sum(per_source[s][:j])
                pieces.append(slice(begin, begin + per_source[s][j]))
            rows = torch.cat([ids_in[p] for p in pieces]) - self.mine(t.name).row0
            bags = torch.cat([bags_in[p] for p in pieces])
            weights = torch.cat([w_in[p] for p in pieces]) if weighted[j] else None
            step.routed[t.name] = Routed(rows, bags, weights)
            if t.sharding == "row" and t.pooling == "mean":
                step.lengths[t.name] = lengths_of[t.name]
        return step

    # --- pooling and the way back ------------------------------------------------------------------------
    def forward(self, features: Mapping[str, Bag]) -> torch.Tensor:
        step = self._route(features) if self.device.type != "meta" else simulated_route(self, features)
        for name, cache in self.caches.items():  # a cached table's rows brought in (they stay until the step)
            cache.fetch(step.routed[name].rows)
        anchor = torch.zeros((), requires_grad=torch.is_grad_enabled())
        pooled = _Lookup.apply(anchor, self, step)
        if not torch.is_grad_enabled():  # no gradient will wait for a step: the rows may leave
            for cache in self.caches.values():
                cache.step_done()
        return pooled

    def _pool(self, step: LookupState) -> torch.Tensor:
        W, B = self.world, step.batch
        blocks: list[list[torch.Tensor]] = [[] for _ in range(W)]  # per destination: my column blocks
        partials = []
        for t in self.tables:
            r, s = step.routed[t.name], self.mine(t.name)
            if t.sharding == "row":
                rows = self.weight(t.name).index_select(0, self._index(t.name, r.rows))
                if r.weights is not None:
                    rows = rows * r.weights.unsqueeze(1)
                partials.append(torch.zeros(W * B, t.dim, device=self.device).index_add_(0, r.bags, rows))
            elif not s.empty:
                offsets = torch.searchsorted(r.bags, torch.arange(W * B, device=self.device))
                pooled = F.embedding_bag(self._index(t.name, r.rows), self.weight(t.name), offsets, mode=t.pooling,
                                         per_sample_weights=r.weights)
                for d in range(W):
                    blocks[d].append(pooled[d * B:(d + 1) * B].reshape(-1))
        out_sizes = [B * sum(self.shards[t.name][h].cols for t in self.tables if t.sharding != "row")
                     for h in range(W)]
        sent = [torch.cat(b) if b else torch.empty(0, device=self.device) for b in blocks]
        received = torch.empty(sum(out_sizes), device=self.device)
        self.group.all_to_all_v(received, torch.cat(sent), out_sizes, [x.numel() for x in sent])
        pieces = list(received.split(out_sizes))
        by_table: dict[str, list[torch.Tensor]] = {t.name: [] for t in self.tables}
        for h in range(W):
            at = 0
            for t in self.tables:
                cols = self.shards[t.name][h].cols
                if t.sharding != "row" and cols:
                    by_table[t.name].append(pieces[h][at:at + B * cols].view(B, cols))
                    at += B * cols
        if partials:
            summed = torch.empty(B, sum(p.shape[1] for p in partials), device=self.device)
            self.group.reduce_scatter(summed, torch.cat(partials, 1).contiguous()).wait()
            at = 0
            for t in (t for t in self.tables if t.sharding == "row"):
                block = summed[:, at:at + t.dim]
                at += t.dim
                if t.pooling == "mean":
                    block = block / step.lengths[t.name].clamp(min=1).unsqueeze(1).to(block.dtype)
                by_table[t.name] = [block]
        return torch.cat([torch.cat(by_table[t.name], 1) for t in self.tables], 1)

    def _backward(self, step: LookupState, grad: torch.Tensor) -> None:
        """Each holder's rows' gradients from the pooled gradient ``grad`` ``(B, sum dims)``: pending."""
        W, B = self.world, step.batch
        grad = grad.contiguous()
        at, row_grads = 0, []
        blocks: list[list[torch.Tensor]] = [[] for _ in range(W)]
        for t in self.tables:
            g = grad[:, at:at + t.dim]
            at += t.dim
            if t.sharding == "row":
                if t.pooling == "mean":
                    g = g / step.lengths[t.name].clamp(min=1).unsqueeze(1).to(g.dtype)
                row_grads.append(g)
                continue
            for h in range(W):
                s = self.shards[t.name][h]
                if s.cols:
                    blocks[h].append(g[:, s.col0:s.col1].reshape(-1))
        sent = [torch.cat(b) if b else torch.empty(0, device=self.device) for b in blocks]
        mine = [self.mine(t.name).cols if t.sharding != "row" else 0 for t in self.tables]
        received = torch.empty(W * B * sum(mine), device=self.device)
        self.group.all_to_all_v(received, torch.cat(sent), [B * sum(mine)] * W, [x.numel() for x in sent])
        per_source = received.view(W, B * sum(mine)) if sum(mine) else None
        gathered = None
        if row_grads:
            local = torch.cat(row_grads, 1).contiguous()
            gathered = torch.empty(W * B, local.shape[1], device=self.device)
            self.group.all_gather(gathered, local).wait()
        at_col, at_row = 0, 0
        for j, t in enumerate(self.tables):
            r = step.routed[t.name]
            if t.sharding == "row":
                assert gathered is not None
                pooled_grad = gathered[:, at_row:at_row + t.dim]
                at_row += t.dim
            elif mine[j]:
                assert per_source is not None
                pooled_grad = per_source[:, at_col:at_col + B * mine[j]].reshape(W * B, mine[j])
                at_col += B * mine[j]
                if t.pooling == "mean":
                    counts = (torch.bincount(r.bags, minlength=W * B) if not r.bags.is_meta
                              else torch.empty(W * B, dtype=torch.long, device="meta")).clamp(min=1)
                    pooled_grad = pooled_grad / counts.unsqueeze(1).to(pooled_grad.dtype)
            else:
                continue
            if r.rows.numel() == 0:
                continue
            contrib = pooled_grad.index_select(0, r.bags)
            if r.weights is not None:
                contrib = contrib * r.weights.unsqueeze(1)
            unique, inverse = unique_rows(r.rows, self.mine(t.name).rows)
            summed = torch.zeros(unique.numel(), contrib.shape[1], device=self.device)
            summed.index_add_(0, inverse, contrib)
            self.pending[t.name].append((unique, summed / W))

    # --- the optimizer -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Apply every table's pending row gradients (all micro-batches since the last step), then clear them."""
        merged = {t.name: self._merged(t) for t in self.tables}
        whole_rows = [t for t in self.tables
                      if self.optim_config.type == "rowwise_adagrad" and t.sharding == "column" and self.world > 1]
        squares = self._whole_row_squares(whole_rows, [merged[t.name][1] for t in whole_rows])
        for t in self.tables:
            rows, grad = merged[t.name]
            index = self._index(t.name, rows)
            if t.name in squares:
                self.optimizers[t.name].update(index, grad, squares[t.name], t.dim)
            else:
                self.optimizers[t.name].update(index, grad)
            if t.name in self.caches:
                self.caches[t.name].changed(index)
            self.pending[t.name].clear()
        for cache in self.caches.values():
            cache.step_done()

    def _merged(self, t: TableConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``t``'s pending micro-batches as one (unique rows, summed gradients)."""
        pending = self.pending[t.name]
        if len(pending) == 1:
            return pending[0]
        if not pending:
            return (torch.empty(0, dtype=torch.long, device=self.device),
                    torch.empty(0, self.mine(t.name).cols, device=self.device))
        rows, inverse = unique_rows(torch.cat([p[0] for p in pending]), self.mine(t.name).rows)
        grad = torch.zeros(rows.numel(), pending[0][1].shape[1], device=self.device).index_add_(
            0, inverse, torch.cat([p[1] for p in pending]))
        return rows, grad

    def _index(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Where local ``rows`` of table ``name`` are in its buffer: themselves, or their cache slots."""
        cache = self.caches.get(name)
        return rows if cache is None or rows.is_meta else cache.slots_of(rows)

    def cache_hit_rates(self) -> dict[str, float]:
        """Each cached table's hit rate on this rank (distinct rows found resident / distinct rows fetched)."""
        return {name: cache.hit_rate() for name, cache in self.caches.items()}

    def _whole_row_squares(self, tables: list[TableConfig], grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Row-wise Adagrad on column-wise tables: each looked-up row's squared gradient summed over all its
        columns, per table. Every column holder got the same ids, so the same unique rows in the same order;
        ranks holding no column learn the counts and add zeros. Two collectives per step for all such tables:
        the counts, then every table's squares in one buffer."""
        if not tables:
            return {}
        if grads[0].is_meta:
            return {t.name: g.pow(2).sum(1) for t, g in zip(tables, grads)}
        rows = torch.tensor([float(g.shape[0]) for g in grads], device=self.device)
        self.group.all_reduce(rows).wait()
        holders = [sum(1 for s in self.shards[t.name] if s.cols) for t in tables]
        counts = [int(r) // h for r, h in zip(rows.tolist(), holders)]
        squares = torch.cat([g.pow(2).sum(1) if g.shape[1] else torch.zeros(n, device=self.device)
                             for g, n in zip(grads, counts)])
        self.group.all_reduce(squares).wait()
        return {t.name: part for t, part in zip(tables, squares.split(counts))}

    def drop_pending(self) -> None:
        """Forget the pending row gradients (a skipped step)."""
        for pending in self.pending.values():
            pending.clear()
        for cache in self.caches.values():
            cache.step_done()


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, ebc: EmbeddingBagCollection, step: LookupState) -> torch.Tensor:
        ctx.ebc, ctx.step = ebc, step
        return ebc._pool(step)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.ebc._backward(ctx.step, grad)
        return None, None, None


__all__ = ["Bag", "EmbeddingBagCollection", "table_owners"]
