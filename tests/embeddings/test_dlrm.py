"""DLRM through ``zeroplus.initialize``: the dense MLPs under ZeRO, the tables sharded (``zeroplus.embeddings``).

On 1 rank (ZeRO-2) and 2 and 4 gloo ranks (ZeRO-3), a DLRM with four tables (table-, row- and column-wise; one
larger than a rank's share would hold whole at 2 ranks) trains 3 steps on synthetic Criteo-like batches (power-law ids,
so duplicates; empty bags) against one process holding the same model with ``nn.EmbeddingBag(sparse=True)``
tables over every rank's batch, the loss the mean of the ranks' losses, stepped by ``torch.optim.AdamW``
(dense) and ``torch.optim.Adagrad`` (tables). Checked: every rank's loss at every step within 1e-5, the
dense weights (``consolidated_fp32_state``) and the assembled tables after the steps within 1e-5 relative,
and the ledger: this rank's table shards under ``param`` plus its dense share, its Adagrad states under
``optim_state`` beside AdamW's, each category's peak as ``zeroplus.estimate`` predicted it before the run from a
builder and as the engine's own estimate did from the module (the tables built again on the meta device for the
rank, ``embeddings/simulated.py``). Refused: fp16 and gradient clipping with tables, naming the key.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroplus
from tests.dist_helper import run_distributed
from zeroplus.config import ConfigError
from zeroplus.embeddings import SparseOptimConfig, TableConfig
from zeroplus.embeddings.sparse_optim import state_bytes
from zeroplus.embeddings.tables import shard
from zeroplus.ledger import Category
from zeroplus.models.dlrm import DLRM, DLRMConfig, synthetic_batch

STEPS, BATCH, LR = 3, 6, 0.05
CFG = DLRMConfig(dense_features=5, bottom=(12, 8), top=(16,),
                 tables=[TableConfig("big", 40, 8, sharding="row"), TableConfig("c1", 11, 8, sharding="table"),
                         TableConfig("c2", 17, 8, sharding="column", pooling="mean"),
                         TableConfig("c3", 5, 8, sharding="table")])
SPARSE = SparseOptimConfig("adagrad", lr=LR)


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "warning", "memory_estimate": False},
            **extra}


def _batch(step: int, rank: int) -> tuple:
    return synthetic_batch(CFG, BATCH, torch.Generator().manual_seed(10 * step + rank))


def _initial() -> tuple[dict, dict]:
    """The dense weights and whole tables every run starts from."""
    torch.manual_seed(0)
    model = DLRM(CFG, SPARSE)
    g = torch.Generator().manual_seed(3)
    tables = {t.name: torch.randn(t.num_embeddings, t.dim, generator=g) * 0.1 for t in CFG.tables}
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dense, tables


def _sharded(stage: int) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dense, tables = _initial()
    model = DLRM(CFG, SPARSE)
    model.load_state_dict(dense, strict=False)
    for name, full in tables.items():
        model.embeddings.load_table(name, full)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    budget = zeroplus.estimate(lambda: DLRM(CFG, SPARSE), _config(stage), world_size=world, rank=rank,
                               example_inputs=_batch(0, rank))
    engine = zeroplus.initialize(model, _config(stage, zeroplus={"log_level": "warning"}))  # its own estimate on
    ebc = model.embeddings
    ledger = {"param": engine.ledger.live_bytes(Category.PARAM),
              "optim_state": engine.ledger.live_bytes(Category.OPTIM_STATE)}
    losses = []
    for step in range(STEPS):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.consolidated_fp32_state()
    kinds = ("param", "grad", "master", "optim_state")
    own = engine.memory_report().predicted_category_peaks() or {}  # the engine's, from the module at its first forward
    predicted = {c: (budget.category_peaks[c], own.get(c), engine.ledger.peak_bytes(Category(c))) for c in kinds}
    result = {"predicted": predicted, "losses": losses, "dense": state,
              "tables": {t.name: ebc.full_table(t.name) for t in CFG.tables},
              "ledger": ledger, "owners": ebc.owners, "world": ebc.world, "rank": rank}
    engine.destroy()
    return result


class _Bags(nn.Module):
    def __init__(self, tables: dict) -> None:
        super().__init__()
        self.bags = nn.ModuleDict({t.name: nn.EmbeddingBag(t.num_embeddings, t.dim, mode=t.pooling, sparse=True)
                                   for t in CFG.tables})
        with torch.no_grad():
            for name, full in tables.items():
                self.bags[name].weight.copy_(full)

    def forward(self, sparse: dict) -> torch.Tensor:
        return torch.cat([self.bags[t.name](*sparse[t.name]) for t in CFG.tables], 1)


def _reference(world: int) -> dict:
    dense, tables = _initial()
    model = DLRM(CFG, SPARSE)
    model.load_state_dict(dense, strict=False)
    model.embeddings = _Bags(tables)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    adamw = torch.optim.AdamW(dense_params, lr=1e-2, weight_decay=0.01)
    adagrad = torch.optim.Adagrad(model.embeddings.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        per_rank = [model(*_batch(step, rank)) for rank in range(world)]
        (sum(per_rank) / world).backward()
        adamw.step()
        adagrad.step()
        model.zero_grad(set_to_none=True)
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "dense": {n: p.detach() for n, p in model.named_parameters()
                                        if not n.startswith("embeddings.")},
            "tables": {n: b.weight.detach() for n, b in model.embeddings.bags.items()}}


def _check(got: list[dict], world: int) -> None:
    ref = _reference(world)
    dense_bytes = sum(p.numel() * 4 for p in ref["dense"].values())
    for r in got:
        rank = r["rank"]
        assert r["world"] == world
        for step in range(STEPS):
            assert r["losses"][step] == pytest.approx(ref["losses"][step][rank], rel=1e-5), f"rank {rank} step {step}"
        for name, value in ref["dense"].items():
            torch.testing.assert_close(r["dense"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")
        for name, value in ref["tables"].items():
            torch.testing.assert_close(r["tables"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: table {name}")
        shards = [shard(t, world, rank, r["owners"].get(t.name, 0)) for t in CFG.tables]
        table_bytes = sum(s.rows * s.cols * 4 for s in shards)
        table_states = sum(state_bytes(SPARSE, s.rows, s.cols) for s in shards)
        assert r["ledger"]["param"] - table_bytes in (dense_bytes, dense_bytes // world, 0), (rank, r["ledger"])
        assert r["ledger"]["optim_state"] - table_states >= 0, (rank, r["ledger"])
        assert all(p == q == m for p, q, m in r["predicted"].values()), (rank, r["predicted"])  # predicted, measured
        assert table_bytes < sum(t.num_embeddings * t.dim * 4 for t in CFG.tables) or world == 1


def test_dlrm_trains_as_one_process_on_one_rank() -> None:
    _check([_sharded(2)], 1)


@pytest.mark.parametrize("world", [2, 4])
def test_dlrm_trains_as_one_process_on_several_ranks_at_zero_3(world: int) -> None:
    _check(run_distributed(_sharded, world, 3), world)


def test_tables_refuse_fp16_and_gradient_clipping() -> None:
    with pytest.raises(ConfigError, match="'gradient_clipping' is 1.0"):
        zeroplus.initialize(DLRM(CFG, SPARSE), _config(2) | {"gradient_clipping": 1.0})
    with pytest.raises(ConfigError, match="enables fp16"):
        zeroplus.initialize(DLRM(CFG, SPARSE), _config(2) | {"fp16": {"enabled": True}})
