"""Sharded embedding tables (``zeroplus/embeddings``) against one process with ``nn.EmbeddingBag``.

Each case trains a collection of five tables (sizes 5-13 rows, 2-5 columns; sum and mean pooling; per-sample
weights on two; table-, row- and column-wise, all alike and mixed) for 3 steps on 1, 2 and 4 gloo ranks, each
rank with its own 3 bags per table (empty bags, duplicate ids within a bag and across ranks). The reference
is one process holding every table as ``nn.EmbeddingBag(sparse=True)`` over all ranks' bags, the loss the
mean of the ranks' losses, stepped by ``torch.optim.Adagrad``, ``SGD``, ``SparseAdam`` or a plain statement of
row-wise Adagrad. Checked: every rank's pooled output at every step (within 1e-6: row-wise sums its partials
in another order; column- and table-wise pool the same ids in the same order) and every table after the
steps, assembled from the shards, within 1e-5 relative; and that no rank holds more of a table than its shard.
A failure names the world size, the case and the table or step.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_helper import run_distributed
from zeroplus.embeddings import EmbeddingBagCollection, SparseOptimConfig, TableConfig
from zeroplus.embeddings.tables import shard_bytes

B, STEPS = 3, 3
SIZES = [("t0", 11, 4, "sum", True), ("t1", 13, 3, "mean", False), ("t2", 7, 5, "sum", False),
         ("t3", 9, 4, "sum", True), ("t4", 5, 2, "mean", False)]
MIXED = ["table", "row", "column", "row", "table"]
CASES = {"table": (["table"] * 5, "adagrad"), "row": (["row"] * 5, "adagrad"), "column": (["column"] * 5, "adagrad"),
         "mixed-sgd": (MIXED, "sgd"), "mixed-rowwise": (MIXED, "rowwise_adagrad"), "mixed-adam": (MIXED, "adam"),
         "auto": (["auto"] * 5, "rowwise_adagrad")}


def _tables(shardings: list[str]) -> list[TableConfig]:
    return [TableConfig(name, n, d, pooling, sharding)  # type: ignore[arg-type]
            for (name, n, d, pooling, _), sharding in zip(SIZES, shardings)]


def _full_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(n, d, generator=g) for name, n, d, _, _ in SIZES}


def _features(step: int, rank: int) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(100 * step + rank)
    out = {}
    for name, n, _, _, weighted in SIZES:
        lengths = torch.randint(0, 4, (B,), generator=g)
        lengths[step % B] = 0 if rank == 0 else lengths[step % B]  # an empty bag on rank 0 each step
        ids = torch.randint(0, min(n, 4), (int(lengths.sum()),), generator=g)  # few distinct ids: duplicates
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.3, torch.randint(0, n, ids.shape, generator=g), ids)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        out[name] = (ids, offsets, torch.rand(ids.shape, generator=g) + 0.5 if weighted else None)
    return out


def _target(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(900 + 10 * step + rank)
    return torch.randn(B, sum(d for _, _, d, _, _ in SIZES), generator=g)


def _pooled(bags: dict[str, nn.EmbeddingBag], feats: dict[str, tuple]) -> torch.Tensor:
    return torch.cat([bags[name](ids, offsets, per_sample_weights=w) for name, (ids, offsets, w) in feats.items()], 1)


def _run_sharded(world: int) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    results = {}
    for case, (shardings, opt) in CASES.items():
        tables = _tables(shardings)
        ebc = EmbeddingBagCollection(tables, SparseOptimConfig(opt, lr=0.1))
        for name, full in _full_weights().items():
            ebc.load_table(name, full)
        held = {t.name: ebc.weight(t.name).numel() * 4 for t in tables}
        outputs = []
        for step in range(STEPS):
            out = ebc(_features(step, rank))
            (out * _target(step, rank)).sum().backward()
            ebc.step()
            outputs.append(out.detach())
        results[case] = {"outputs": outputs, "tables": {t.name: ebc.full_table(t.name) for t in tables},
                         "held": held, "owners": ebc.owners, "planned": ebc.tables}
    return results


def _rowwise_adagrad(weight: nn.Parameter, state: torch.Tensor, lr: float, eps: float = 1e-10) -> None:
    grad = weight.grad.coalesce()
    rows, values = grad.indices()[0], grad.values()
    s = state[rows] + values.pow(2).mean(1)
    state[rows] = s
    with torch.no_grad():
        weight[rows] = weight[rows] + (-lr) * (values / (s.sqrt() + eps).unsqueeze(1))


def _reference(world: int, opt: str) -> dict:
    bags = {name: nn.EmbeddingBag(n, d, mode=pooling, sparse=True) for name, n, d, pooling, _ in SIZES}
    with torch.no_grad():
        for name, full in _full_weights().items():
            bags[name].weight.copy_(full)
    params = [b.weight for b in bags.values()]
    optim = {"sgd": lambda: torch.optim.SGD(params, lr=0.1), "adagrad": lambda: torch.optim.Adagrad(params, lr=0.1),
             "adam": lambda: torch.optim.SparseAdam(params, lr=0.1), "rowwise_adagrad": lambda: None}[opt]()
    states = {name: torch.zeros(n) for name, n, _, _, _ in SIZES}
    outputs = []
    for step in range(STEPS):
        per_rank = []
        loss = torch.zeros(())
        for rank in range(world):
            feats = _features(step, rank)
            out = _pooled(bags, feats)
            loss = loss + (out * _target(step, rank)).sum() / world
            per_rank.append(out.detach())
        loss.backward()
        if optim is None:
            for name, b in bags.items():
                _rowwise_adagrad(b.weight, states[name], 0.1)
        else:
            optim.step()
        for b in bags.values():
            b.weight.grad = None
        outputs.append(per_rank)
    return {"outputs": outputs, "tables": {name: b.weight.detach() for name, b in bags.items()}}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_sharded_tables_train_as_one_process_with_embedding_bags(world: int) -> None:
    got = [_run_sharded(1)] if world == 1 else run_distributed(_run_sharded, world, world)
    for case, (shardings, opt) in CASES.items():
        ref = _reference(world, opt)
        for rank, result in enumerate(got):
            mine = result[case]
            for step in range(STEPS):
                where = f"world {world}, {case}, step {step}, rank {rank}"
                torch.testing.assert_close(mine["outputs"][step], ref["outputs"][step][rank], rtol=1e-6, atol=1e-6,
                                           msg=lambda m, w=where: f"{w}: {m}")
            for t in mine["planned"]:
                assert t.sharding != "auto"
                torch.testing.assert_close(mine["tables"][t.name], ref["tables"][t.name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=t.name: f"world {world}, {case}, table {n}: {m}")
                expected = shard_bytes(t, world, rank, mine["owners"].get(t.name, 0))
                assert mine["held"][t.name] == expected, f"world {world}, {case}, table {t.name}, rank {rank}"


def _bad_id_on_rank_1() -> str:
    rank = torch.distributed.get_rank()
    ebc = EmbeddingBagCollection(_tables(MIXED))
    feats = _features(0, rank)
    if rank == 1:
        ids, offsets, w = feats["t2"]
        feats["t2"] = (torch.cat([ids, torch.tensor([70])]), offsets, w)
    try:
        ebc(feats)
    except ValueError as err:
        return str(err)
    return "no error"


def test_bad_input_is_refused_on_every_rank_naming_the_table_the_id_and_the_rank() -> None:
    for rank, message in enumerate(run_distributed(_bad_id_on_rank_1, 2)):
        assert "table 't2' on rank 1: id 70 is outside its 7 rows" in message, f"rank {rank}: {message}"
    ebc = EmbeddingBagCollection(_tables(MIXED))
    feats = _features(0, 0)
    ids, offsets, _ = feats["t1"]
    with pytest.raises(ValueError, match="table 't1' on rank 0: per-sample weights need sum pooling"):
        ebc({**feats, "t1": (ids, offsets, torch.ones(ids.shape))})
    with pytest.raises(ValueError, match=r"features for tables \['t4'\] are missing"):
        ebc({k: v for k, v in feats.items() if k != "t4"})
    with pytest.raises(ValueError, match="table 't0'.*owner 3 is not a rank of a group of 1"):
        EmbeddingBagCollection([TableConfig("t0", 4, 2, owner=3)])
    with pytest.raises(ValueError, match="sharding must be one of.*'diagonal'"):
        TableConfig("t0", 4, 2, sharding="diagonal")  # type: ignore[arg-type]


def test_micro_batches_accumulate_until_the_step() -> None:
    """Two micro-batches, then one step: as the reference's two backwards into one sparse gradient."""
    ebc = EmbeddingBagCollection(_tables(MIXED), SparseOptimConfig("adam", lr=0.1))
    bags = {name: nn.EmbeddingBag(n, d, mode=pooling, sparse=True) for name, n, d, pooling, _ in SIZES}
    for name, full in _full_weights().items():
        ebc.load_table(name, full)
        with torch.no_grad():
            bags[name].weight.copy_(full)
    optim = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=0.1)
    for step in range(2):
        for micro in range(2):
            feats, target = _features(step, micro), _target(step, micro)
            (ebc(feats) * target).sum().backward()
            (_pooled(bags, feats) * target).sum().backward()
        ebc.step()
        optim.step()
        optim.zero_grad()
    for name, b in bags.items():
        torch.testing.assert_close(ebc.full_table(name), b.weight.detach(), rtol=1e-5, atol=1e-6, msg=name)
