"""``engine.offload_states()`` / ``reload_states()`` (RL frameworks free the device between
steps this way), on 2 gloo ranks at stages 1 and 3, fp32 and bf16.

After two steps the optimizer states, masters and parameters leave the device: the ledger shows their
categories at 0 bytes, a forward is an error naming ``reload_states()``; after reloading every state
is bitwise what it was, and the next steps' losses equal an uninterrupted run's bit for bit. A subset
(``include=["optim_states"]``) moves only those; an unknown kind is an error naming the kinds.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.ledger import Category


def _engine(stage: int, dtype: str):
    torch.manual_seed(0)
    return zeroplus.initialize(ParityNet(), {
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zeroplus": {"log_level": "warning", "memory_estimate": False}})


def _states(engine) -> dict:
    out = {}
    for g in engine.partition.groups:
        out[g.name] = g.master_store.read(0, g.owned_numel).clone()
        for key, value in engine.optimizer.state.get(g.master_param, {}).items():
            out[f"{g.name}/{key}"] = value.clone()
    return out


def _run(stage: int, dtype: str) -> dict:
    rank, world = rank_and_world()
    batches = make_batches(8 * world, 2)
    straight = _engine(stage, dtype)
    expected = engine_train(straight, batches, 4, rank, world, 1)
    engine = _engine(stage, dtype)
    losses = engine_train(engine, batches, 2, rank, world, 1)
    before = _states(engine)
    live = {c: engine.ledger.live_bytes(c) for c in (Category.OPTIM_STATE, Category.MASTER, Category.PARAM)}
    only = engine.offload_states(include=["optim_states"])
    partial = {c: engine.ledger.live_bytes(c) for c in live}
    engine.reload_states()
    moved = engine.offload_states()
    after_offload = {c: engine.ledger.live_bytes(c) for c in live}
    x, y = batches[0]
    try:
        engine(x, y)
        refused = None
    except RuntimeError as err:
        refused = str(err)
    engine.reload_states()
    same = all(torch.equal(v, before[k]) for k, v in _states(engine).items())
    losses += engine_train(engine, batches, 2, rank, world, 1, start=2)
    try:
        engine.offload_states(include=["optimizer"])
        unknown = None
    except ValueError as err:
        unknown = str(err)
    return {"live": live, "partial": partial, "offloaded": after_offload, "moved": moved, "only": only,
            "refused": refused, "same": same, "losses": losses, "expected": expected, "unknown": unknown}


@pytest.mark.parametrize("stage,dtype", [(1, "bf16"), (3, "fp32"), (3, "bf16")])
def test_offload_and_reload_states_is_bit_exact_and_frees_the_device(stage, dtype):
    for rank, r in enumerate(run_distributed(_run, 2, stage, dtype)):
        optim, master = Category.OPTIM_STATE, Category.MASTER
        assert r["live"][optim] > 0 and r["offloaded"][optim] == 0 and r["offloaded"][master] == 0, r
        assert r["partial"][optim] == 0 and r["partial"][master] == r["live"][master], "include= moves only those"
        assert r["only"] == r["live"][optim] and r["moved"] >= r["live"][optim] + r["live"][master], r
        assert r["refused"] is not None and f"rank {rank}" in r["refused"] and "reload_states()" in r["refused"]
        assert r["same"], "every master and optimizer state is bitwise what it was"
        assert r["losses"] == r["expected"], "training after the round trip equals an uninterrupted run"
        assert r["unknown"] is not None and "unknown state kinds ['optimizer']" in r["unknown"]
