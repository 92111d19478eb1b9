"""Sparse reduction of embedding rows into gradient shards (stages 2-3).

An embedding's gradient is zero except in the rows of the tokens a micro-batch used, so reducing
it as a dense table sends and holds V * d elements for at most T * d of content (T tokens). At stages 2-3 the per-token
sums an embedding's backward produces (``use_grads.py``) are kept as ``(ids, sums)`` until the
backward ends; then, per parameter, every rank's token count is exchanged, each rank's rows are
padded to the largest (room for every token, so the buffers' size does not depend on how many
tokens repeat: the budget predicts them exactly) and all-gathered (ids, then values), and each
rank adds, divided by D,
the parts of the rows that fall inside its owned range into its gradient shard. Shard boundaries
need not fall on row boundaries: positions are computed per element.

Memory (T_max: the most tokens any rank's micro-batch gave the embedding): the gathered rows,
N * T_max * (d * c + 8) bytes (``comm_buffer``), and the positions of the rows touching the owned
range, 8 bytes per element. Communication: one all-gather of N counts per group, and
N * T_max * (d * c + 8) bytes per parameter, instead of V * d * c. Sums
over ranks are formed in rank order, so values equal the dense reduction's within fp32
rounding (the dense path adds in the backend's order).

Rows pay only while few: where the gathered rows take at least the bytes of the group's dense gradient
(N * sum(T_max * (d * c + 8)) >= P * c; a small vocabulary, a position table), the first backward's count
exchange decides that the group's rows go into its flat gradient, reduced with one collective when the backward
ends (``choose_dense``), that backward's rows included: from then on no count exchange, no gathers per table, no
value read on the host. The widths are every rank's, so every rank decides the same; every backward of a run
(a resumed one too) then reduces the same way; the memory estimate runs the same rule.
See note: sparse embedding rows.
"""
from __future__ import annotations

import torch

from ..ledger import Category
from .flat_group import FlatParamGroup
from .grad_arrival import Rows


def row_widths(group: FlatParamGroup, rows: dict[int, Rows]) -> list[int]:
    """The most tokens any rank of the group gave each row parameter (sorted indices) in this backward: every
    rank's counts all-gathered (a collective: every rank calls it for the same group, even with no rows)."""
    dp = group.dp
    local = [sum(tokens for _, _, tokens in rows.get(i, [])) for i in sorted(group.gradient.arrival.row_params)]
    if group.device.type == "meta":  # the memory estimate: no values; every rank taken to have as many tokens
        return local
    every = torch.empty(dp.size * len(local), dtype=torch.int64)
    dp.all_gather(every, torch.tensor(local, dtype=torch.int64)).wait()
    return every.view(dp.size, len(local)).max(dim=0).values.tolist()


def reduce_rows(group: FlatParamGroup, rows: dict[int, Rows], widest: list[int], scale: float,
                shard_dtype: torch.dtype) -> None:
    """Add every rank's ``rows`` (``widest``: ``row_widths``) into ``group``'s gradient shard (created as zeros in
    ``shard_dtype`` if this backward reduced nothing dense into it). A collective, as ``row_widths``."""
    dp, ledger, device = group.dp, group.ledger, group.device
    params = sorted(group.gradient.arrival.row_params)
    simulated = device.type == "meta"
    shard = group.gradient.ensure_reduced(shard_dtype)
    lo, hi = group.owned_start, group.owned_start + group.owned_numel
    for i, width in zip(params, widest):
        if width == 0:
            continue
        off, (_, d) = group.offsets[i], group.shapes[i]
        ids = torch.full((width,), -1, dtype=torch.int64, device=device)
        sums = ledger.zeros(width * d, group.compute_dtype, Category.COMM_BUFFER, device)
        at = 0
        for part_ids, part_sums, _ in rows.get(i, []):
            n = part_ids.numel()
            ids[at:at + n] = part_ids
            sums[at * d:(at + n) * d] = part_sums.reshape(-1)
            at += n
        all_ids = torch.empty(dp.size * width, dtype=torch.int64, device=device)
        all_sums = ledger.empty(dp.size * width * d, group.compute_dtype, Category.COMM_BUFFER, device)
        dp.all_gather(all_ids, ids).wait()
        dp.all_gather(all_sums, sums).wait()
        del sums
        if simulated:
            continue
        first_row, end_row = (lo - off) // d, -(-(hi - off) // d)  # rows whose span meets [lo, hi)
        touching = (all_ids >= max(0, first_row)) & (all_ids < end_row)
        if not bool(touching.any()):
            continue
        positions = (off - lo) + all_ids[touching].unsqueeze(1) * d + torch.arange(d, device=device)
        values = all_sums.view(-1, d)[touching]
        inside = (positions >= 0) & (positions < hi - lo)
        shard.index_add_(0, positions[inside], values[inside].to(shard.dtype).mul_(scale))


def choose_dense(group: FlatParamGroup, widest: list[int]) -> bool:
    """Whether ``group``'s rows go into its flat gradient, from this backward on: once gathering them (``widest``
    tokens per row parameter on every one of N ranks, ids and values) takes at least the flat gradient's bytes."""
    c = group.compute_dtype.itemsize
    params = sorted(group.gradient.arrival.row_params)
    rows = group.dp.size * sum(w * (group.shapes[i][1] * c + 8) for i, w in zip(params, widest))
    if rows >= group.padded_numel * c:
        group.gradient.arrival.rows_dense = True
    return group.gradient.arrival.rows_dense
