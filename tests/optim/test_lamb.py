"""zeroplus's LAMB against the plain reference (``tests/reference.PlainLamb``).

Unsharded (one process) and sharded at ZeRO stages 1-3 on 2 ranks, where a flat shard holds
pieces of several parameters and the per-parameter norms are summed across ranks: losses and
parameters within 1e-5 relative over 5 steps (the trust ratio's float64 norms are summed in a
different order, so not bitwise). A failure at stage 0 points at the update math; only at
stages 1-3, at the shard segments or the norm all-reduce.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, reference_train

STEPS, GAS, MICRO, LR = 5, 1, 2, 5e-3


def _run(stages: list[int]) -> list[dict]:
    rank, world = rank_and_world()
    out = []
    for stage in stages:
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "lamb", "params": {
            "lr": LR, "weight_decay": 0.01}}, "zero_optimization": {"stage": stage, "reduce_bucket_size": 50,
                                                                   "stage3_param_persistence_threshold": 0},
               "zeroplus": {"log_level": "warning", "memory_estimate": False}}
        engine = zeroplus.initialize(ParityNet(), cfg)
        assert type(engine.optimizer).__name__ == "Lamb"
        losses = engine_train(engine, make_batches(STEPS * world, MICRO), STEPS, rank, world, GAS)
        out.append({"losses": losses, "state": engine.consolidated_fp32_state()})
    return out


def _check(results: list[dict], stages: list[int], world: int) -> None:
    torch.manual_seed(0)
    ref_losses, ref_state = reference_train(ParityNet(), make_batches(STEPS * world, MICRO), STEPS, world, GAS, LR,
                                            0.0, optimizer="Lamb")
    for stage, r in zip(stages, results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, s=stage: f"Lamb stage {s} world {world}: losses\n{m}")
        for name, value in r["state"].items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-5 * ref_state[name].abs().max(),
                                       msg=lambda m, s=stage, n=name: f"Lamb stage {s} world {world}: {n}\n{m}")


def test_lamb_unsharded_matches_reference():
    _check(_run([0]), [0], 1)


def test_lamb_sharded_matches_reference():
    stages = [1, 2, 3]
    _check(run_distributed(_run, 2, stages)[0], stages, 2)


def test_lamb_rejects_bad_hyperparameters():
    from zeroplus.optim.lamb import Lamb
    with pytest.raises(ValueError, match=r"betas must be in \[0, 1\), got \(1.5, 0.9\)"):
        Lamb([torch.nn.Parameter(torch.ones(2))], betas=(1.5, 0.9))
