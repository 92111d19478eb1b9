"""The four DeepSpeed schedules against DeepSpeed's own implementations, step by step.

Each schedule drives two identical optimizers (one through zeroplus's class, one through
DeepSpeed's) for 60 steps; the learning rates (and OneCycle's momentum) must be equal to 1e-12
at every step. Also: ``warmup_num_steps: 0`` means no warm-up (DeepSpeed rejects it), and
schedules survive a state_dict round trip.
"""
from __future__ import annotations

import pytest
import torch

from zeroplus.optim.schedulers import build_scheduler

ds_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")

CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 20}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 50, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3,
                       "warmup_num_steps": 15}),
    ("WarmupCosineLR", {"total_num_steps": 50, "warmup_min_ratio": 0.1, "warmup_num_steps": 12,
                        "cos_min_ratio": 0.01}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10,
                  "cycle_second_step_size": 15, "decay_lr_rate": 0.1, "decay_step_size": 5,
                  "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.05}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 8,
                  "cycle_first_stair_count": 4}),
]


def _opt() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


@pytest.mark.parametrize("name,params", CASES)
def test_schedule_matches_deepspeed(name, params):
    ours_opt, ds_opt = _opt(), _opt()
    ours = build_scheduler(name, dict(params), ours_opt)
    ds = getattr(ds_schedules, name)(ds_opt, **params)
    for step in range(60):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(ds_opt.param_groups[0]["lr"], abs=1e-12), \
            f"{name} lr at step {step}"
        assert ours_opt.param_groups[0]["betas"] == pytest.approx(ds_opt.param_groups[0]["betas"], abs=1e-12), \
            f"{name} betas at step {step}"
        ours.step()
        ds.step()


def test_zero_warmup_means_no_warmup():
    opt = _opt()
    sched = build_scheduler("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-4, "warmup_num_steps": 0}, opt)
    for _ in range(3):
        assert opt.param_groups[0]["lr"] == 5e-4
        sched.step()


def test_state_dict_round_trip_and_unknown_schedule():
    opt = _opt()
    sched = build_scheduler("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5}, opt)
    for _ in range(7):
        sched.step()
    lr = opt.param_groups[0]["lr"]
    opt2 = _opt()
    other = build_scheduler("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5}, opt2)
    other.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == lr
    with pytest.raises(ValueError, match="scheduler.type 'Cosine' is not supported"):
        build_scheduler("Cosine", {}, opt)
    with pytest.raises(ValueError, match="scheduler.params for WarmupLR"):
        build_scheduler("WarmupLR", {"warmup_steps": 3}, opt)
