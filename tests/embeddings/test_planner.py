"""The table planner (``zeroplus/embeddings/planner.py``) on Criteo's 26 tables (the Kaggle set's cardinalities,
dimension 16), and ``"auto"`` tables through a collection.

Checked: every ``"auto"`` table gets a sharding (table-wise ones an owner); the plan's bytes per rank are the
shard math's (``tables.shard`` and ``sparse_optim.state_bytes``), within 5% of an even split at 2 and 8 ranks,
and fit the budget given; the largest tables go row-wise, the small ones whole; a budget too small is
refused naming the table, its bytes, the rank and what would fit, and the world size it names does fit (one
fewer does not); sharding given by hand is kept. The collection plans its ``"auto"`` tables the same way
(``test_collection.py`` trains them against ``nn.EmbeddingBag``).
"""
from __future__ import annotations

import re

import pytest

from zeroplus.embeddings import EmbeddingBagCollection, SparseOptimConfig, TableConfig
from zeroplus.embeddings.planner import TablePlanError, plan_tables, table_bytes
from zeroplus.models.dlrm import CRITEO_ROWS, criteo_config

TABLES = list(criteo_config(16).tables)
ROWWISE = SparseOptimConfig("rowwise_adagrad")


@pytest.mark.parametrize("world", [2, 8])
def test_every_auto_table_is_placed_and_the_bytes_are_balanced(world: int) -> None:
    plan = plan_tables(TABLES, world, ROWWISE)
    assert all(t.sharding in ("table", "row") for t in plan.tables)
    assert all(t.owner is not None for t in plan.tables if t.sharding == "table")
    held = [sum(table_bytes(t, ROWWISE, world, r, t.owner or 0) for t in plan.tables) for r in range(world)]
    assert held == plan.bytes_per_rank
    whole = sum(n * 16 * 4 + n * 4 for n in CRITEO_ROWS)
    assert max(held) <= 1.05 * whole / world + 4 * world, held  # (+ the row-wise ceil's rounding)
    assert sum(held) == whole
    kinds = {t.name: t.sharding for t in plan.tables}
    assert kinds["c0"] == kinds["c8"] == "table"  # small: whole on a rank
    if world == 8:
        assert kinds["c2"] == "row"  # 10M rows: more than an eighth of all bytes


def test_a_budget_too_small_is_refused_naming_the_table_and_what_would_fit() -> None:
    adagrad = SparseOptimConfig("adagrad")
    budget = 2**30
    with pytest.raises(TablePlanError) as caught:
        plan_tables(TABLES, 2, adagrad, per_rank_bytes=budget)
    message = str(caught.value)
    assert re.search(r"table 'c\d+' \([\d,]+ bytes with its adagrad state\) does not fit a budget of 1,073,741,824",
                     message), message
    assert "rank 0" in message and "rowwise_adagrad" in message
    ranks = int(re.search(r"fits with (\d+) ranks", message).group(1))
    plan = plan_tables(TABLES, ranks, adagrad, per_rank_bytes=budget)
    assert max(plan.bytes_per_rank) <= budget
    with pytest.raises(TablePlanError):
        plan_tables(TABLES, ranks - 1, adagrad, per_rank_bytes=budget)
    needed = int(re.search(r"or with ([\d,]+) bytes per rank on 2 ranks", message).group(1).replace(",", ""))
    assert max(plan_tables(TABLES, 2, adagrad, per_rank_bytes=needed).bytes_per_rank) <= needed


def test_shardings_given_are_kept_and_auto_tables_fill_around_them() -> None:
    tables = [TableConfig("big", 1000, 8, sharding="column"), TableConfig("a", 50, 8, sharding="auto"),
              TableConfig("b", 40, 8, sharding="table", owner=1), TableConfig("c", 30, 8, sharding="auto")]
    plan = plan_tables(tables, 2, ROWWISE)
    assert [t.sharding for t in plan.tables][::2] == ["column", "table"]
    assert plan.tables[2].owner == 1
    with pytest.raises(ValueError, match=r"lookups name tables \['nope'\]"):
        plan_tables(tables, 2, lookups={"nope": 3.0})


def test_a_collection_plans_its_auto_tables() -> None:
    tables = [TableConfig("big", 4000, 8, sharding="auto"), TableConfig("small", 30, 8, sharding="auto")]
    ebc = EmbeddingBagCollection(tables, ROWWISE)  # one rank: everything whole
    assert [(t.sharding, t.owner) for t in ebc.tables] == [("table", 0), ("table", 0)]
    assert ebc.weight("big").shape == (4000, 8)
