"""The engine's API contract on one process: client optimizers and schedulers, param groups,
accumulation boundaries, no_sync, and bad input.

Single-process runs are the same code path as N ranks (the collectives short-circuit), so these
check the bookkeeping; the distributed behaviour is in tests/zero.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeroplus
from tests.models import ParityNet, make_batches

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

BASE = {"train_micro_batch_size_per_gpu": 2, "zeroplus": {"log_level": "warning"}}


def _decay_groups(model: torch.nn.Module, lr_no_decay: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr_no_decay}]


def _train_in_lockstep(engine, ref: torch.nn.Module, ref_opt: torch.optim.Optimizer, steps: int,
                       ref_sched=None) -> None:
    """Train the engine and the plain reference on the same batches; their fp32 weights must be equal."""
    for x, y in make_batches(steps, 2):
        engine.backward(engine(x, y))
        engine.step()
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if ref_sched is not None:
            ref_sched.step()
    state = engine.consolidated_fp32_state()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(state[name], p.detach()), name


@pytest.mark.parametrize("stage", [0, 3])
def test_param_groups_and_client_scheduler_match_torch(stage):
    """Two param groups with their own lr and weight decay, a client LambdaLR: the same trajectory
    as torch's AdamW + LambdaLR on the plain module."""
    torch.manual_seed(0)
    model = ParityNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(_decay_groups(model, 3e-3), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = zeroplus.initialize(model, {**BASE, "zero_optimization": {"stage": stage}}, optimizer=opt,
                                 lr_scheduler=sched)
    assert engine.optimizer is opt and engine.lr_scheduler is sched
    ref_opt = torch.optim.AdamW(_decay_groups(ref, 3e-3), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    _train_in_lockstep(engine, ref, ref_opt, 4, ref_sched)
    assert engine.get_lr() == [g["lr"] for g in ref_opt.param_groups]


def test_model_parameters_with_groups_and_config_optimizer():
    torch.manual_seed(0)
    model = ParityNet()
    ref = copy.deepcopy(model)
    cfg = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine = zeroplus.initialize(model, cfg, model_parameters=_decay_groups(model, 3e-3))
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-2, 3e-3]
    ref_opt = torch.optim.AdamW(_decay_groups(ref, 3e-3), lr=1e-2, fused=True)  # zeroplus's default kernel
    _train_in_lockstep(engine, ref, ref_opt, 3)


def test_accumulation_boundary_and_step_counting():
    engine = zeroplus.initialize(ParityNet(), {**BASE, "gradient_accumulation_steps": 3,
                                               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    seen = []
    for x, y in make_batches(6, 2):
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
    assert seen == [False, False, True, False, False, True]
    assert engine.global_steps == 2 and engine.micro_steps == 6
    assert engine.get_global_grad_norm() > 0


def test_no_sync_accumulates_at_stage_1_and_is_refused_at_stage_2():
    torch.manual_seed(0)
    model = ParityNet()
    ref = copy.deepcopy(model)
    engine = zeroplus.initialize(model, {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                         "zero_optimization": {"stage": 1}})
    (x1, y1), (x2, y2) = make_batches(2, 2)
    with engine.no_sync():
        engine.backward(engine(x1, y1))
    engine.backward(engine(x2, y2))
    engine.step()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    (ref(x1, y1) + ref(x2, y2)).backward()
    ref_opt.step()
    state = engine.consolidated_fp32_state()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(state[name], p.detach(), rtol=1e-6, atol=1e-7)
    engine2 = zeroplus.initialize(ParityNet(), {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="no_sync\\(\\) is not possible at ZeRO stage 2"):
        with engine2.no_sync():
            pass


def test_bad_inputs_are_clear_errors():
    engine = zeroplus.initialize(ParityNet(), {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    x, y = make_batches(1, 2)[0]
    with pytest.raises(TypeError, match="scalar loss tensor"):
        engine.backward(engine(x, y).repeat(2))
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        zeroplus.initialize("not a model", BASE)
    with pytest.raises(ValueError, match=r"unit_modules names \['Nope'\]"):
        zeroplus.initialize(ParityNet(), {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                          "zeroplus": {"unit_modules": ["Nope"]}})


def test_memory_report_for_people_and_tools():
    engine = zeroplus.initialize(ParityNet(), {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    report = engine.memory_report()
    d = report.to_dict()
    assert d["categories"]["optim_state"]["live_bytes"] > 0 and d["total"]["peak_bytes"] >= d["total"]["live_bytes"]
    text = str(report)
    assert "optim_state" in text and "device peak above start" in text


def test_inert_and_unimplemented_options_are_warned_about_once(caplog):
    import logging
    logger = logging.getLogger("zeroplus")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="zeroplus"):
            zeroplus.initialize(ParityNet(), {
                **BASE, "zeroplus": {"log_level": "warning", "quantized_weights_dtype": "bf16"},
                "eigenvalue": {"enabled": False},
                "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}},
                "zero_optimization": {"stage": 1, "allgather_bucket_size": 2e8, "sub_group_size": 1e8}})
    finally:
        logger.removeHandler(caplog.handler)
    text = caplog.text
    assert "does not implement yet (ignored): eigenvalue" in text
    assert "accepted but without effect yet: zero_optimization.allgather_bucket_size; " \
           "zero_optimization.sub_group_size; zeroplus.quantized_weights_dtype (qwZ's codes; " \
           "zero_optimization.zero_quantized_weights is off)" in text
    assert "['torch_adam'] are DeepSpeed-only" in text
    assert text.count("without effect yet") == 1
