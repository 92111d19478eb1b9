"""Checkpoints of sharded embedding tables (``engine/checkpoints/table_shards.py``).

A DLRM on 2 gloo ranks (ZeRO-2, row-, table- and column-wise tables, Adagrad) trains 2 steps and saves;
its third step is the reference. Loaded by a fresh engine on 2 ranks with the same sharding, the tables,
their Adagrad sums and the step count equal the saved ones bit for bit and the third step's loss equals the
reference's bit for bit. Loaded on 1 rank and on 4 ranks with every table row-wise (another world size and
another sharding), the assembled tables and states equal the saved ones bit for bit. Loading tables of
another size is refused before anything changes.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.embeddings.test_dlrm import CFG, SPARSE, _batch, _config
from zeroplus.embeddings import TableConfig
from zeroplus.models.dlrm import DLRM, DLRMConfig


def _model(cfg: DLRMConfig, seed: int) -> DLRM:
    torch.manual_seed(seed)
    return DLRM(cfg, SPARSE, seed=seed)


def _snapshot(model: DLRM) -> dict:
    ebc = model.embeddings
    return {t.name: (ebc.full_table(t.name), ebc.full_table(t.name, "sum"), ebc.optimizers[t.name].step_count)
            for t in ebc.tables}


def _save(path: str) -> dict:
    rank = torch.distributed.get_rank()
    model = _model(CFG, 0)
    engine = zeroplus.initialize(model, _config(2))
    for step in range(2):
        loss = engine(*_batch(step, rank))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(path, tag="t")
    saved = _snapshot(model)
    loss = engine(*_batch(2, rank))
    engine.backward(loss)
    engine.step()
    return {"saved": saved, "next_loss": loss.item()}


def _load(path: str, cfg: DLRMConfig) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    model = _model(cfg, 5)
    engine = zeroplus.initialize(model, _config(2))
    engine.load_checkpoint(path, tag="t")
    loaded = _snapshot(model)
    loss = engine(*_batch(2, rank))
    return {"loaded": loaded, "next_loss": loss.item()}


def _same(a: dict, b: dict, where: str) -> None:
    for name, (table, state, step) in a.items():
        assert torch.equal(table, b[name][0]), f"{where}: table {name}"
        assert torch.equal(state, b[name][1]), f"{where}: Adagrad sums of {name}"
        assert step == b[name][2], f"{where}: step count of {name}"


def test_tables_save_per_shard_resume_bitwise_and_reshard(tmp_path) -> None:
    path = str(tmp_path)
    saved = run_distributed(_save, 2, path)
    same = run_distributed(_load, 2, path, CFG)
    for rank in range(2):
        _same(saved[rank]["saved"], same[rank]["loaded"], f"2 ranks, rank {rank}")
        assert same[rank]["next_loss"] == saved[rank]["next_loss"], f"rank {rank}: the step after resuming"
    rows = DLRMConfig(dense_features=CFG.dense_features, bottom=CFG.bottom, top=CFG.top,
                      tables=[TableConfig(t.name, t.num_embeddings, t.dim, t.pooling, "row") for t in CFG.tables])
    for world in (1, 4):
        got = run_distributed(_load, world, path, rows) if world > 1 else [_load(path, rows)]
        for rank, result in enumerate(got):
            _same(saved[0]["saved"], result["loaded"], f"{world} ranks, all row-wise, rank {rank}")


def test_tables_of_another_size_are_refused(tmp_path) -> None:
    run_distributed(_save, 2, str(tmp_path))
    other = DLRMConfig(dense_features=CFG.dense_features, bottom=CFG.bottom, top=CFG.top,
                       tables=[TableConfig("big", 41, 8)] + list(CFG.tables[1:]))
    with pytest.raises(ValueError, match=r"table 'embeddings.weight__big'.*40 x 8, this model's 41 x 8"):
        _load(str(tmp_path), other)
