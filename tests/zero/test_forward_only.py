"""An engine without an optimizer (TRL's reference model: ``deepspeed.initialize(model, config)`` with no
optimizer anywhere) and each parameter's ``ds_status``, on 2 gloo ranks.

Forward-only: the outputs equal the plain model's, no byte of gradient, master or optimizer state is
allocated, and ``backward()``/``step()`` are errors on every rank naming why. ``ds_status``: what TRL's
fused LM head asks before reading a parameter directly; it must say ``NOT_AVAILABLE`` for a released
stage-3 parameter (TRL then gathers it) and ``AVAILABLE`` when its values are there.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import VOCAB, ParityNet
from zeroplus.ledger import Category
from zeroplus.zero.param_status import ParamStatus

CONFIG = {"train_micro_batch_size_per_gpu": 2, "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _forward_only(stage: int) -> dict:
    torch.manual_seed(0)
    model, plain = ParityNet(), ParityNet()
    plain.load_state_dict(model.state_dict())
    engine = zeroplus.initialize(model, {**CONFIG, "zero_optimization": {"stage": stage}})
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = engine(x, x), plain(x, x)
    out = {"equal": torch.equal(ours, theirs), "bytes": {c.value: engine.ledger.peak_bytes(c) for c in
                                                          (Category.GRAD, Category.MASTER, Category.OPTIM_STATE)},
           "param_bytes": engine.ledger.live_bytes(Category.PARAM),
           "model_bytes": sum(p.numel() * 4 for p in plain.parameters())}
    loss = engine(x, x)
    for call in ("backward", "step"):
        try:
            engine.backward(loss) if call == "backward" else engine.step()
            out[call] = None
        except RuntimeError as err:
            out[call] = str(err)
    return out


@pytest.mark.parametrize("stage", [0, 3])
def test_an_engine_without_an_optimizer_runs_forward_only(stage):
    for rank, out in enumerate(run_distributed(_forward_only, 2, stage)):
        assert out["equal"], "forward-only outputs equal the plain model's"
        assert out["bytes"] == {"grad": 0, "master": 0, "optim_state": 0}, out["bytes"]
        if stage == 3:  # partitioned as frozen parameters are: this rank's half (and padding), in the ledger
            assert out["model_bytes"] / 2 <= out["param_bytes"] < out["model_bytes"] / 2 + 4 * 64, out
        for call in ("backward", "step"):
            assert out[call] is not None and f"{call}() on rank {rank}: this engine was initialized without an " \
                                              f"optimizer" in out[call] and "'optimizer' block" in out[call], out[call]


def _statuses() -> list:
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), {**CONFIG, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    up, frozen = engine.module.blocks[0].up.weight, engine.module.frozen.weight
    seen = [up.ds_status, frozen.ds_status]
    with zeroplus.GatheredParameters([up, frozen]):
        seen += [up.ds_status, frozen.ds_status]
    seen += [up.ds_status, frozen.ds_status]
    return seen


def test_ds_status_says_whether_a_stage3_parameter_holds_its_values():
    """At stage 3 trained and frozen parameters alike are released between uses."""
    released, there = ParamStatus.NOT_AVAILABLE, ParamStatus.AVAILABLE
    for seen in run_distributed(_statuses, 2):
        assert seen == [released, released, there, there, released, released], seen
