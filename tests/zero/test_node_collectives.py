"""The two-level collectives over nodes where a node's ranks and the nodes differ in number: MiCS's hierarchical
gather (``zero/two_level_gather.py``; see note: mics hierarchical gather) and qgZ's two-level reduce-scatter
(``zero/quantized_comm.py``; see note: qgz). The engine tests run them at 2 nodes of 2, where a node's index and a
rank's place in it take the same values; here 6 gloo ranks as 3 nodes of 2 and as 2 nodes of 3.

The gather: every rank's distinct part lands where a one-level all-gather over the 6 ranks puts it, bit for bit.
The reduce-scatter: each rank's landed shard is within the two-level bound of the exact scaled sum of every rank's
row for it (half a step of each rank's block, plus half a step of each node's partial sum), added into what the
target held. Each fails with a node's index taken for a place (the offsets of the other layout).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist_helper import rank_and_world, run_distributed
from tests.zero.test_qgz import COLUMNS, SCALE, _half_steps, _rows
from zeroplus.comm import DataParallelGroup
from zeroplus.ledger import Ledger
from zeroplus.zero import quantized_comm
from zeroplus.zero.two_level_gather import TwoLevelGather

WORLD, PART = 6, 5


def _groups(rank: int, size: int) -> tuple[DataParallelGroup, DataParallelGroup]:
    """Nodes of ``size`` consecutive ranks: this rank's node and the ranks at its place in each (every group made on
    every rank, in one order)."""
    nodes = [list(range(i, i + size)) for i in range(0, WORLD, size)]
    places = [list(range(p, WORLD, size)) for p in range(size)]
    node = [DataParallelGroup(dist.new_group(r), "node") for r in nodes][rank // size]
    across = [DataParallelGroup(dist.new_group(r), "across") for r in places][rank % size]
    return node, across


def _both_layouts() -> list[dict]:
    rank, world = rank_and_world()
    out = []
    for size in (2, 3):  # 3 nodes of 2, 2 nodes of 3
        node, across = _groups(rank, size)
        part = torch.arange(PART, dtype=torch.float32) + 100 * rank
        gathered = torch.empty(world * PART)
        TwoLevelGather(node, across, Ledger()).all_gather(gathered, part).wait()
        target = torch.full((COLUMNS,), 1.5)
        quantized_comm.reduce_scatter_rows(DataParallelGroup(None), _rows(rank, world), target, SCALE, True,
                                           Ledger(), (node, across)).wait()
        out.append({"gathered": gathered, "reduced": target})
    return out


def test_two_level_collectives_over_nodes_of_two_and_of_three():
    rows = [_rows(r, WORLD) for r in range(WORLD)]
    whole = torch.cat([torch.arange(PART, dtype=torch.float32) + 100 * r for r in range(WORLD)])
    for rank, layouts in enumerate(run_distributed(_both_layouts, WORLD)):
        for size, got in zip((2, 3), layouts):
            assert torch.equal(got["gathered"], whole), (rank, size, got["gathered"])
            mine = torch.stack([r[rank] for r in rows])  # every rank's row for this rank
            exact = mine.sum(0) * SCALE
            first = _half_steps(mine)
            nodes = range(0, WORLD, size)
            partial = torch.stack([mine[i:i + size].sum(0) for i in nodes])
            slack = torch.stack([first[i:i + size].sum(0) for i in nodes])
            bound = (first.sum(0) + _half_steps(partial.abs() + slack).sum(0)) * SCALE * (1 + 1e-5)
            error = (got["reduced"] - 1.5 - exact).abs()
            assert (error <= bound + exact.abs() * 1e-6 + 1.5e-6).all(), (rank, size, (error - bound).max())
