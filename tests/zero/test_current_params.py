"""Parameters read through the user's own model object after ``step()`` (stages 1-2, two ranks).

What a user's EMA update, logger or evaluation reads is ``model.parameters()`` of the object passed to
``initialize``, not ``engine.module``. By default ``step()`` returns with the post-step all-gathers complete, so
those tensors equal the plain module's after the same steps (AdamW, fp32, rtol 1e-6). With
``zeroplus.overlap_param_gather`` the gathers are waited by the next forward: the tensors read directly hold, element
by element, the value before or after the step (this rank's shard is written at once, the rest arrives with the
gather), some of them stale, and ``engine.module`` makes them all current. A failure of the first case localises
to the wait at the end of ``step()`` (``engine/engine.py``); of the second to the deferral (the per-unit wait).
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, reference_train

STEPS, MICRO, LR = 3, 2, 1e-2


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(stage: int, overlap: bool) -> list[tuple[dict, dict]]:
    """(the model object's parameters right after each step, then those read through engine.module)."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = ParityNet()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage},
              "zeroplus": {"log_level": "warning", "memory_estimate": False, "overlap_param_gather": overlap}}
    engine = zeroplus.initialize(model, config)
    seen: list[tuple[dict, dict]] = []

    def after_step() -> None:
        direct = _snapshot(model)
        seen.append((direct, _snapshot(engine.module)))

    engine_train(engine, make_batches(STEPS * world, MICRO), STEPS, rank, world, 1, on_step=after_step)
    engine.destroy()
    return seen


def _reference_after(steps: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ParityNet()
    if steps == 0:
        return _snapshot(model)
    return reference_train(model, make_batches(STEPS * world, MICRO), steps, world, 1, LR, 0.0)[1]


def _assert_equal(got: dict, want: dict, label: str) -> None:
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=lambda m: f"{label} {name}: {m}")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["current", "overlap_param_gather"])
def test_model_object_after_step(stage: int, overlap: bool) -> None:
    world = 2
    refs = [_reference_after(s, world) for s in range(STEPS + 1)]
    stale_elements = 0
    for rank, seen in enumerate(run_distributed(_train, world, stage, overlap)):
        for s, (direct, through_engine) in enumerate(seen):
            label = f"stage {stage} rank {rank} after step {s + 1}"
            _assert_equal(through_engine, refs[s + 1], f"{label}, engine.module")
            if not overlap:
                _assert_equal(direct, refs[s + 1], f"{label}, model.parameters()")
                continue
            for name, value in direct.items():
                before, after = refs[s][name], refs[s + 1][name]
                near = torch.isclose(value, before, rtol=1e-6, atol=1e-7) | torch.isclose(value, after, rtol=1e-6,
                                                                                         atol=1e-7)
                assert bool(near.all()), f"{label}, {name}: neither the value before nor after the step"
                stale_elements += int((~torch.isclose(value, after, rtol=1e-6, atol=1e-7)).sum())
    if overlap:  # the deferral is real: the key changes what a direct read sees
        assert stale_elements > 0, f"stage {stage}: overlap_param_gather left nothing to wait for after step()"
