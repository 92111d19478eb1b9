"""Model-state bytes predicted on the meta device equal what the engine allocates.

For the built-in GPT and ParityNet (odd sizes, tied weights, a frozen layer), ZeRO stages 0-3,
fp32, bf16 and bf16 with shared master weights, on 2 real ranks: the prediction for each rank
(``zeroplus.budget.model_state_bytes``) equals that rank's ledger exactly: ``param``,
``param_gathered`` and ``master`` right after ``initialize``, ``optim_state`` after the first
step (AdamW and SGD with momentum), also with optimizer states offloaded at ratio 0.5 and
parameter shards offloaded (what stays on the device). At 1024 ranks the prediction takes seconds, and every
sharded category shrinks as 1/N (up to each group's padding to a multiple of N). ``zeroplus
estimate --json`` prints the same numbers; an unknown model size is an error naming it.
"""
from __future__ import annotations

import json
import tempfile
import time

import pytest
import torch

import zeroplus
from tests.cli_run import run_cli
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.budget import model_state_bytes
from zeroplus.ledger import Category
from zeroplus.models import GPT, gpt_config

CATEGORIES = [Category.PARAM, Category.PARAM_GATHERED, Category.MASTER]


def _tiny_gpt() -> GPT:
    return GPT(gpt_config("tiny"))


def _config(stage: int, dtype: str, shared: bool, optimizer: str, root: str | None = None) -> dict:
    """``optimizer`` "AdamW+offload": states in files at ratio 0.5 (sub-groups of 100 elements) and,
    at stage 3, the parameter shards too; "AdamW+offload+fp8": fp8 moments so (sub-groups of 256: two blocks)."""
    params = {"lr": 1e-3, "momentum": 0.9} if optimizer == "SGD" else {"lr": 1e-3}
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 500}
    states = {}
    if "+offload" in optimizer:
        fp8 = optimizer.endswith("+fp8")
        optimizer, path = "AdamW", tempfile.mkdtemp(prefix="offload-", dir=root)
        zero.update(sub_group_size=300 if fp8 else 100,
                    offload_optimizer={"device": "nvme", "nvme_path": path, "ratio": 0.5})
        states = {"exp_avg": "fp8", "exp_avg_sq": "fp8"} if fp8 else {}
        if stage == 3:
            zero["offload_param"] = {"device": "nvme", "nvme_path": path}
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": optimizer, "params": params}, "zero_optimization": zero,
            "zeroplus": {"log_level": "warning", "shared_master_weights": shared, "memory_estimate": False,
                         "optimizer_states": states}}


CASES = [(stage, dtype, shared, opt) for stage in range(4)
         for dtype, shared, opt in [("fp32", False, "AdamW"), ("bf16", False, "SGD"), ("bf16", True, "AdamW")]]
CASES += [(3, "bf16", False, "AdamW+offload"), (2, "bf16", False, "AdamW+offload"),
          (2, "bf16", False, "AdamW+offload+fp8")]


def _job(model_name: str, root: str) -> list:
    rank, world = rank_and_world()
    build = {"gpt": _tiny_gpt, "parity": ParityNet}[model_name]
    out = []
    for stage, dtype, shared, opt in CASES:
        cfg = _config(stage, dtype, shared, opt, root)
        predicted = model_state_bytes(build, cfg, world, rank)
        torch.manual_seed(0)
        engine = zeroplus.initialize(build(), cfg)
        at_init = {c.value: engine.ledger.live_bytes(c) for c in CATEGORIES}
        if model_name == "parity":
            engine_train(engine, make_batches(world, 2), 1, rank, world, 1)
        else:
            x = torch.randint(0, 256, (2, 16))
            engine.backward(engine(x, x))
            engine.step()
        at_init[Category.OPTIM_STATE.value] = engine.ledger.live_bytes(Category.OPTIM_STATE)
        out.append((predicted, at_init))
    return out


@pytest.mark.parametrize("model_name", ["gpt", "parity"])
def test_prediction_equals_the_ledger(model_name, tmp_path):
    for rank_result in run_distributed(_job, 2, model_name, str(tmp_path)):
        for (stage, dtype, shared, opt), (predicted, measured) in zip(CASES, rank_result):
            assert {k: predicted[k] for k in measured} == measured, f"stage {stage} {dtype} shared {shared} {opt}"
            if "+offload" in opt:  # half the states (whole sub-groups) and, at stage 3, every master off
                assert 0 < predicted["optim_state"] < predicted["optim_state_offloaded"] + predicted["optim_state"]
                assert (predicted["master"] == 0) == (stage == 3)


def test_a_thousand_ranks_in_seconds_and_one_over_n():
    cfg = _config(3, "bf16", False, "AdamW")
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    big = lambda: GPT(gpt_config("111m"))  # noqa: E731
    start = time.perf_counter()
    at_1024 = model_state_bytes(big, cfg, 1024, rank=1023)
    assert time.perf_counter() - start < 30
    at_2 = model_state_bytes(big, cfg, 2)
    for key in ("master", "optim_state"):
        assert at_1024[key] * 512 == pytest.approx(at_2[key], rel=1e-3), key
    with torch.device("meta"):
        total = sum(p.numel() for p in big().parameters())  # tied weights counted once by parameters()
    assert at_2["master"] == pytest.approx(4 * total / 2, rel=1e-5)
    assert at_2["optim_state"] == pytest.approx(8 * total / 2, rel=1e-5)


def test_command_line_prints_the_same_prediction(tmp_path, capsys):
    cfg = _config(3, "bf16", True, "AdamW")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    cmd = ["estimate", "--model", "tiny", "--config", str(path), "--world-size", "8", "--rank", "7", "--json"]
    status, out, err = run_cli(cmd, capsys)
    assert status == 0, err
    printed = json.loads(out)["model_state_bytes"]
    expected = model_state_bytes(_tiny_gpt, cfg, 8, 7)
    assert printed == dict(expected, total_on_device=sum(expected.values()))
    status, _, err = run_cli(cmd[:2] + ["huge"] + cmd[3:], capsys)
    assert status == 2 and "unknown GPT size 'huge'" in err
