"""Tables on a tier with their hot rows cached (``row_cache.py``, ``row_tier.py``): the same training, bit for bit.

The cache itself, on a file tier and on the host tier: least recently used rows leave first, a changed row is
written back before it leaves and read back changed, rows looked up since the last step stay, the hit rate counts
distinct rows, and a step needing more distinct rows than the cache holds is refused naming the table. Through a
collection, on 1 and 2 gloo ranks: tables of 60-70 rows cached 12-25 rows at a time on files (table- and row-wise;
Adagrad, row-wise Adagrad, Adam; two micro-batches per step) give the same pooled outputs, tables and optimizer
states as the same collection holding every row, bit for bit (the same values, the same arithmetic, only indexed by
slot); the ledger counts the slots, not the shard. A DLRM through ``initialize`` with a cached table saves and
resumes bit for bit, its checkpoint loads into the uncached model equal, and the estimate predicts its ``param``
and ``optim_state`` bytes (the slots and the row map) as the ledger counts them. Refused: a cache without a tier, a
cache on a column-wise table.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from zeroplus.accelerator import get_accelerator
from zeroplus.embeddings import EmbeddingBagCollection, SparseOptimConfig, TableConfig
from zeroplus.embeddings.row_cache import CacheTooSmall, RowCache
from zeroplus.embeddings.tables import TableTier
from zeroplus.ledger import Category, Ledger
from zeroplus.models.dlrm import DLRM, DLRMConfig, synthetic_batch
from zeroplus.offload.tiers import FileTier, HostTier


@pytest.mark.parametrize("kind", ["file", "host"])
def test_least_recently_used_rows_leave_and_changed_rows_come_back_changed(kind: str, tmp_path) -> None:
    weight = torch.arange(20 * 2, dtype=torch.float32).view(20, 2)
    tier = FileTier(str(tmp_path), Ledger()) if kind == "file" else HostTier(get_accelerator(), Ledger())
    cache = RowCache(20, {"weight": 2, "sum": 1}, 4, tier,
                     {"weight": weight.clone(), "sum": torch.zeros(20)}, "t")
    cache.fetch(torch.tensor([3, 4, 3]))
    cache.step_done()
    cache.fetch(torch.tensor([7, 8]))
    s = cache.slots_of(torch.tensor([7]))
    cache.slots["weight"][s] = -1.0
    cache.slots["sum"][s] = 5.0
    cache.changed(s)
    cache.step_done()
    cache.fetch(torch.tensor([3]))  # 3 used again: 4 is now the least recently used
    cache.step_done()
    cache.fetch(torch.tensor([10, 11]))  # two slots needed: 4 and then 7 (changed: written back) leave
    assert cache.slots_of(torch.tensor([3, 8, 10, 11])).min() >= 0
    assert cache.slots_of(torch.tensor([4, 7])).tolist() == [-1, -1]
    cache.step_done()
    cache.fetch(torch.tensor([7]))
    s = cache.slots_of(torch.tensor([7]))
    assert cache.slots["weight"][s].tolist() == [[-1.0, -1.0]] and cache.slots["sum"][s].tolist() == [5.0]
    assert cache.hits == 1 and cache.fetched == 8  # distinct per fetch: 3, 4 | 7, 8 | 3 (the hit) | 10, 11 | 7
    expected = weight.clone()
    expected[7] = -1.0
    assert torch.equal(cache.whole("weight"), expected)
    with pytest.raises(CacheTooSmall, match=r"table 't': the row cache holds 4 rows and this step needs 6"):
        cache.fetch(torch.tensor([0, 1, 2, 5, 6]))  # 7 is pinned since the last step_done
    cache.close()


B, STEPS = 3, 3
SIZES = [("t0", 60, 4, "sum", "table"), ("t1", 70, 3, "mean", "row"), ("t2", 64, 5, "sum", "row"),
         ("t3", 9, 2, "sum", "column")]
CACHE = 12  # per rank: one step's distinct rows at most (2 micro-batches x 3 bags x 2 ids), times the ranks


def _tables(cached: bool, world: int) -> list[TableConfig]:
    return [TableConfig(name, n, d, pooling, sharding,  # type: ignore[arg-type]
                        cache_rows=(CACHE * world + i % 2) if cached and sharding != "column" else None)
            for i, (name, n, d, pooling, sharding) in enumerate(SIZES)]


def _features(step: int, micro: int, rank: int) -> dict[str, tuple]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    out = {}
    for name, n, _, _, _ in SIZES:
        lengths = torch.randint(0, 3, (B,), generator=g)  # 0-2 ids a bag
        ids = torch.randint(0, n, (int(lengths.sum()),), generator=g)
        out[name] = (ids, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
    return out


def _train(directory: str | None, opt: str) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tier = TableTier("file", directory) if directory else None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    ebc = EmbeddingBagCollection(_tables(directory is not None, world), SparseOptimConfig(opt, lr=0.1), seed=5,
                                 tier=tier)
    outputs = []
    for step in range(STEPS):
        for micro in range(2):
            out = ebc(_features(step, micro, rank))
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outputs.append(out.detach())
        ebc.step()
    states = {name: {k: ebc.full_table(name, k) for k in ebc.optimizers[name].state} for name, *_ in SIZES}
    held = {name: ebc.weight(name).numel() * 4 for name, *_ in SIZES}
    return {"outputs": outputs, "tables": {name: ebc.full_table(name) for name, *_ in SIZES}, "states": states,
            "held": held, "hit_rates": ebc.cache_hit_rates(),
            "evicted": any(cache.fetched - cache.hits > cache.capacity for cache in ebc.caches.values())}


def _both(directory: str, opt: str) -> tuple[dict, dict]:
    return _train(None, opt), _train(directory, opt)


@pytest.mark.parametrize("world", [1, 2])
def test_cached_tables_train_bit_for_bit_as_resident_ones(world: int, tmp_path) -> None:
    for opt in ("adagrad", "rowwise_adagrad", "adam"):
        runs = [_both(str(tmp_path), opt)] if world == 1 else run_distributed(_both, world, str(tmp_path), opt)
        assert any(cached["evicted"] for _, cached in runs), f"world {world}, {opt}: no row ever left a cache"
        for rank, (plain, cached) in enumerate(runs):
            where = f"world {world}, {opt}, rank {rank}"
            assert all(torch.equal(a, b) for a, b in zip(plain["outputs"], cached["outputs"])), where
            for name, *_ in SIZES:
                assert torch.equal(plain["tables"][name], cached["tables"][name]), f"{where}: {name}"
                for k, v in plain["states"][name].items():
                    assert torch.equal(v, cached["states"][name][k]), f"{where}: {name} {k}"
            for i, (name, n, d, _, sharding) in enumerate(SIZES):
                if sharding != "column" and plain["held"][name]:  # a holder: the slots, not the shard
                    slots = (CACHE * world + i % 2) * d * 4
                    assert cached["held"][name] == slots < plain["held"][name], f"{where}: {name}"
            assert cached["hit_rates"] and all(0 <= h < 1 for h in cached["hit_rates"].values()), where


def test_a_cache_needs_a_tier_and_a_table_or_row_wise_table(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"tables \['t0'\] set cache_rows and the collection has no tier"):
        EmbeddingBagCollection([TableConfig("t0", 10, 2, cache_rows=2)])
    with pytest.raises(ValueError, match=r"tables \['t0'\]: cache_rows needs table- or row-wise sharding"):
        EmbeddingBagCollection([TableConfig("t0", 10, 2, sharding="column", cache_rows=2)],
                               tier=TableTier("file", str(tmp_path)))
    with pytest.raises(ValueError, match="cache_rows must be at least 1"):
        TableConfig("t0", 10, 2, cache_rows=0)


CFG = DLRMConfig(dense_features=4, bottom=(8, 4), top=(8,),
                 tables=[TableConfig("big", 30, 4, sharding="row", cache_rows=6), TableConfig("small", 7, 4)])


def _dlrm(directory: str | None, save: str, load: bool) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cfg = CFG if directory else DLRMConfig(CFG.dense_features, [TableConfig("big", 30, 4, sharding="row"),
                                                                 TableConfig("small", 7, 4)], CFG.bottom, CFG.top)
    torch.manual_seed(0)
    model = DLRM(cfg, SparseOptimConfig("rowwise_adagrad", lr=0.1), tier=TableTier("file", directory)
                 if directory else None)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zeroplus": {"log_level": "warning"}}
    world = torch.distributed.get_world_size()
    budget = zeroplus.estimate(lambda: DLRM(cfg, SparseOptimConfig("rowwise_adagrad", lr=0.1),
                                            tier=TableTier("file", directory) if directory else None),
                               config, world_size=world, rank=rank, example_inputs=synthetic_batch(
                                   cfg, 4, torch.Generator().manual_seed(rank)))
    engine = zeroplus.initialize(model, config)
    if load:
        engine.load_checkpoint(save)
    losses = []
    for step in range(2):
        loss = engine(*synthetic_batch(cfg, 4, torch.Generator().manual_seed(10 * step + rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if not load:
        engine.save_checkpoint(save)
    kinds = ("param", "optim_state")
    out = {"predicted": {c: budget.category_peaks[c] for c in kinds},
           "measured": {c: engine.ledger.peak_bytes(Category(c)) for c in kinds},
           "losses": losses, "big": model.embeddings.full_table("big"),
           "sum": model.embeddings.full_table("big", "sum")}
    engine.destroy()
    return out


def _dlrm_runs(directory: str, save: str) -> list[dict]:
    return [_dlrm(directory, save + "/cached", False), _dlrm(None, save + "/plain", False),
            _dlrm(directory, save + "/cached", True), _dlrm(None, save + "/cached", True)]


def test_a_dlrm_with_a_cached_table_saves_and_resumes_as_the_resident_one(tmp_path) -> None:
    for cached, plain, resumed, loaded_plain in run_distributed(_dlrm_runs, 2, str(tmp_path / "tier"),
                                                                str(tmp_path)):
        assert cached["predicted"] == cached["measured"], cached  # the slots, predicted before the run
        assert cached["measured"]["param"] < plain["measured"]["param"]
        assert cached["losses"] == plain["losses"]
        assert torch.equal(cached["big"], plain["big"]) and torch.equal(cached["sum"], plain["sum"])
        assert resumed["losses"] == loaded_plain["losses"]  # the cached checkpoint, loaded cached and resident
        assert torch.equal(resumed["big"], loaded_plain["big"]) and torch.equal(resumed["sum"], loaded_plain["sum"])
