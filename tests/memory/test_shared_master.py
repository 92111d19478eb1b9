"""Shared-storage master weights train bit for bit like a separate bf16 copy rounded the same way.

At stages 0-3 on 1 and 2 ranks, with gradient accumulation, binding clipping and a step chunk
small enough that every group steps in several chunks: the run with
``zeroplus.shared_master_weights`` and the run with a separate fp32 master whose bf16 copy is
rounded like the split (``master_rounding: like_shared``) have identical losses, fp32 masters
and optimizer states after every step, with AdamW and SGD (stepped chunk by chunk) and LAMB
(whose per-parameter norms need each shard stepped whole). The ledger's ``master`` bytes are exactly 2 per owned
parameter lower at stages 0-2 (the residual replaces the fp32 copy; the bf16 halves are the
parameters); at stage 3 both keep 4 per owned parameter (the fp32 master, or the bf16 shard
plus the residual), and shared storage needs no cast buffer for the all-gathers.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from zeroplus.ledger import Category

STEPS, GAS, MICRO = 4, 2, 2


def _config(stage: int, shared: bool, optimizer: str) -> dict:
    params = {"lr": 1e-1, "momentum": 0.9} if optimizer == "SGD" else {"lr": 1e-2, "weight_decay": 0.01}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
            "bf16": {"enabled": True}, "optimizer": {"type": optimizer, "params": params},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "shared_master_weights": shared,
                         "master_step_chunk": 48,
                         "master_rounding": "like_shared"}}


def _optimizer_states(engine) -> dict[str, torch.Tensor]:
    out = {}
    for g in engine.partition.groups:
        for key, value in engine.optimizer.state.get(g.master_param, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == g.owned_numel > 1:
                value = g.gather_owned(value)
            out[f"{g.name}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _trajectory(stage: int, shared: bool, optimizer: str) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(stage, shared, optimizer))
    batches = make_batches(STEPS * GAS * world, MICRO)
    steps = []
    master_bytes = engine.ledger.live_bytes(Category.MASTER)
    for step in range(STEPS):
        loss = 0.0
        for micro in range(GAS):
            x, y = batches[(step * GAS + micro) * world + rank]
            out = engine(x, y)
            engine.backward(out)
            engine.step()
            loss += out.item()
        steps.append({"loss": loss, "masters": engine.consolidated_fp32_state(),
                      "states": _optimizer_states(engine)})
    owned = sum(g.owned_numel for g in engine.partition.groups)
    engine.ledger.reset_peaks()  # a forward's all-gathers: cast buffers, or none
    engine(*batches[rank])
    assert engine.ledger.saved_bytes("shared_master_weights", Category.MASTER) == \
        (2 * owned if shared and stage < 3 else 0)
    assert ("shared_master_weights/master" in engine.memory_report().saved) == (shared and stage < 3)
    return {"steps": steps, "master_bytes": master_bytes, "owned": owned,
            "forward_comm_peak": engine.ledger.peak_bytes(Category.COMM_BUFFER) - engine.dp.pair_bytes}


def _job(optimizers: list[str]) -> dict[str, list[tuple[dict, dict]]]:
    return {optimizer: [(_trajectory(stage, True, optimizer), _trajectory(stage, False, optimizer))
                        for stage in range(4)] for optimizer in optimizers}


_RUNS: dict[int, dict] = {}  # world size -> rank 0's results for every optimizer (one spawn per world size)
_OPTIMIZERS = {1: ["AdamW"], 2: ["AdamW", "SGD", "Lamb"]}


@pytest.mark.parametrize("world,optimizer", [(1, "AdamW"), (2, "AdamW"), (2, "SGD"), (2, "Lamb")])
def test_shared_master_matches_separate_copy_bitwise(world, optimizer):
    if world not in _RUNS:
        _RUNS[world] = run_distributed(_job, world, _OPTIMIZERS[world])[0]
    results = _RUNS[world][optimizer]
    for stage, (shared, separate) in enumerate(results):
        for step, (a, b) in enumerate(zip(shared["steps"], separate["steps"])):
            where = f"stage {stage}, {world} rank(s), {optimizer}, step {step}"
            assert a["loss"] == b["loss"], f"{where}: loss {a['loss']} vs {b['loss']}"
            for name, value in b["masters"].items():
                assert torch.equal(a["masters"][name], value), f"{where}: master {name}"
            assert a["states"].keys() == b["states"].keys(), where
            for name, value in b["states"].items():
                same = torch.equal(a["states"][name], value) if isinstance(value, torch.Tensor) else \
                    a["states"][name] == value
                assert same, f"{where}: optimizer state {name}"
        saved = separate["master_bytes"] - shared["master_bytes"]
        assert saved == (2 * shared["owned"] if stage < 3 else 0), (stage, saved, shared["owned"])
        if stage == 3:
            assert shared["forward_comm_peak"] == 0 < separate["forward_comm_peak"], (shared, separate)


def test_shared_master_needs_bf16():
    cfg = _config(1, True, "AdamW")
    cfg["bf16"] = {"enabled": False}
    with pytest.raises(zeroplus.ConfigError, match="zeroplus.shared_master_weights"):
        zeroplus.initialize(ParityNet(), cfg)
