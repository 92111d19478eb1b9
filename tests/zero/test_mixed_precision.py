"""bf16 and fp16 training against references.

bf16: the engine keeps bf16 parameters (as DeepSpeed does) and fp32 masters; the reference is the
fp32 module under bf16 autocast. They round differently, so losses agree within 3% relative over
5 steps; stages 2 and 3 must agree with each other exactly, since they reduce the same bf16
micro-batch gradients into the same fp32 shards.

fp16: one rank's loss is blown up at step 2 so its gradients overflow; every rank must skip that
step together (masters unchanged, ``skipped_steps == 1``, loss scale halved with hysteresis 1),
and train normally before and after.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, reference_train

STEPS, GAS, MICRO, LR = 5, 2, 2, 1e-2


def _bf16_run(stages: list[int]) -> list[dict]:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage in stages:
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
               "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 64,
                                     "stage3_param_persistence_threshold": 0},
               "zeroplus": {"log_level": "warning", "memory_estimate": False}}
        engine = zeroplus.initialize(ParityNet(), cfg)
        assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
        losses = engine_train(engine, make_batches(STEPS * GAS * world, MICRO), STEPS, rank, world, GAS)
        out.append({"losses": losses, "state": engine.consolidated_fp32_state()})
    return out


def test_bf16_matches_autocast_reference_and_stages_agree():
    stages = [0, 1, 2, 3]
    results = run_distributed(_bf16_run, 2, stages)[0]
    torch.manual_seed(0)
    ref_losses, _ = reference_train(ParityNet(), make_batches(STEPS * GAS * 2, MICRO), STEPS, 2, GAS, LR, 1.0,
                                    autocast=torch.bfloat16)
    for stage, result in zip(stages, results):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=3e-2, atol=0,
                                   msg=lambda m, s=stage: f"bf16 stage {s} vs autocast reference\n{m}")
    # Stages 2 and 3 reduce the same bf16 micro-batch gradients into fp32 shards: identical.
    # (Stages 0 and 1 accumulate micro-batches in bf16 before reducing, so they round differently.)
    assert results[3]["losses"] == results[2]["losses"], "bf16 stage 3 losses differ from stage 2"
    for name, value in results[3]["state"].items():
        assert torch.equal(value, results[2]["state"][name]), f"bf16 stage 3: {name} differs from stage 2"


def _fp16_overflow_run(stage: int, loss_scale: float) -> dict:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "fp16": {"enabled": True, "loss_scale": loss_scale, "initial_scale_power": 8, "hysteresis": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(ParityNet(), cfg)
    batches = make_batches(4 * world, MICRO)
    scales, skipped, changed = [], [], []
    for step in range(4):
        before = engine.consolidated_fp32_state()
        x, y = batches[step * world + rank]
        loss = engine(x, y)
        if step == 2 and rank == 1:
            loss = loss * 1e30  # only rank 1 overflows
        engine.backward(loss)
        engine.step()
        after = engine.consolidated_fp32_state()
        changed.append(any(not torch.equal(before[n], after[n]) for n in before))
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
    out = {"scales": scales, "skipped": skipped, "changed": changed, "global_steps": engine.global_steps}
    engine.destroy()
    return out


def _fp16_overflow_runs() -> dict:
    return {"dynamic": [_fp16_overflow_run(stage, 0.0) for stage in range(4)], "static": _fp16_overflow_run(2, 64.0)}


@pytest.fixture(scope="module")
def fp16_runs() -> list[dict]:
    """One 2-rank run: dynamic loss scaling at stages 0-3, then a static scale at stage 2."""
    return run_distributed(_fp16_overflow_runs, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_skips_on_every_rank(stage, fp16_runs):
    results = [r["dynamic"][stage] for r in fp16_runs]
    for rank, r in enumerate(results):
        assert r["changed"] == [True, True, False, True], f"stage {stage} rank {rank}: {r}"
        assert r["skipped"] == [0, 0, 1, 1], f"stage {stage} rank {rank}: {r}"
        assert r["scales"] == [256.0, 256.0, 128.0, 128.0], f"stage {stage} rank {rank}: {r}"
        assert r["global_steps"] == 4


def test_fp16_static_scale_skips_without_changing_scale(fp16_runs):
    results = [r["static"] for r in fp16_runs]
    for r in results:
        assert r["changed"] == [True, True, False, True]
        assert r["scales"] == [64.0] * 4
