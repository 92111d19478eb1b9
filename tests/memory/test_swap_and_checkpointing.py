"""Swap attention and activation checkpointing give the gradients of the run without them.

Swap: the built-in GPT and the Llama-style model at stages 0 and 3, fp32 and bf16, 2 ranks, the
attention modules' saved tensors swapped to the file tier (the tier that saves memory on a
CPU-only machine): every reduced gradient and loss bitwise equal to no swapping; the ledger shows
the swapped bytes not held after forward, none after backward; no swap file outlives its
backward. On the host tier of a CPU-only machine nothing is claimed as saved.

Checkpointing: the GPT with dropout 0.1 and every block checkpointed through
``zeroplus.checkpointing.checkpoint`` (random state replayed), at stages 0 and 3, with and without
``cpu_checkpointing`` (inputs on the file tier): gradients bitwise equal to no checkpointing.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import LlamaStyleNet, make_batches
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config

CASES = [(stage, dtype) for stage in (0, 3) for dtype in ("fp32", "bf16")]


def _config(stage: int, dtype: str, zp: dict, checkpointing: dict | None = None) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": dtype == "bf16"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "activation_checkpointing": checkpointing or {},
            "zeroplus": dict({"log_level": "warning", "memory_estimate": False}, **zp)}


def _train(model: torch.nn.Module, cfg: dict, swap_dir: str | None = None) -> dict:
    rank, world = rank_and_world()
    engine = zeroplus.initialize(model, cfg)
    batches = [(x % 37, y % 37) for x, y in make_batches(4 * world, 2, seq=16)]
    out = {"losses": [], "grads": [], "saved": [], "files_left": []}
    for step in range(2):
        for micro in range(2):
            torch.manual_seed(100 + step * 2 + micro)  # dropout draws the same masks in both runs
            x, y = batches[(step * 2 + micro) * world + rank]
            loss = engine(x, y)
            out["saved"].append(engine.ledger.saved_bytes("swap_attention", Category.ACTIVATION))
            out["moved"] = engine.ledger.saved_bytes("cpu_checkpointing", Category.ACTIVATION)
            engine.backward(loss)
            out["losses"].append(loss.item())
            if swap_dir is not None:
                out["files_left"].append(sum(len(files) for _, _, files in os.walk(swap_dir)))
            if engine.is_gradient_accumulation_boundary():
                out["grads"].append([(g.gradient.flat if stage_of(engine) == 0 else g.gradient.reduced).clone()
                                     for g in engine.partition.groups])
            engine.step()
    out["saved_after"] = engine.ledger.saved_bytes("swap_attention", Category.ACTIVATION)
    return out


def stage_of(engine) -> int:
    return engine.zero_optimization_stage()


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny")) if kind == "gpt" else LlamaStyleNet()


def _swap_job(kind: str, root: str) -> list:
    rank, _ = rank_and_world()
    out = []
    for stage, dtype in CASES:
        swap_dir = os.path.join(root, f"swap-{kind}-{stage}-{dtype}-{rank}")
        swap = {"swap_attention": {"enabled": True, "min_bytes": 0},
                "activation_tier": {"device": "file", "path": swap_dir}}
        plain = _train(_model(kind), _config(stage, dtype, {}))
        swapped = _train(_model(kind), _config(stage, dtype, swap), swap_dir)
        out.append((plain, swapped))
    return out


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_swap_attention_gradients_are_bitwise_identical(kind, tmp_path):
    results = run_distributed(_swap_job, 2, kind, str(tmp_path))[0]
    for (stage, dtype), (plain, swapped) in zip(CASES, results):
        where = f"{kind} stage {stage} {dtype}"
        assert all(b > 0 for b in swapped["saved"]) and swapped["saved_after"] == 0, (where, swapped["saved"])
        assert swapped["files_left"] == [0] * 4, (where, swapped["files_left"])
        assert plain["losses"] == swapped["losses"], where
        for a, b in zip(plain["grads"], swapped["grads"]):
            for i, (ga, gb) in enumerate(zip(a, b)):
                assert torch.equal(ga, gb), f"{where}: group {i} gradient differs"


def test_swap_to_host_on_a_cpu_machine_claims_no_saving():
    cfg = _config(0, "fp32", {"swap_attention": {"enabled": True, "min_bytes": 0}})
    engine = zeroplus.initialize(_model("gpt"), dict(cfg, gradient_accumulation_steps=1))
    x = torch.randint(0, 256, (2, 16))
    loss = engine(x, x)
    assert engine.ledger.saved_bytes("swap_attention", Category.ACTIVATION) == 0
    engine.backward(loss)


def _checkpoint_job(root: str) -> list:
    rank, _ = rank_and_world()
    out = []
    for stage in (0, 3):
        runs = []
        for checkpoint_blocks, cpu in ((False, False), (True, False), (True, True)):
            torch.manual_seed(0)
            model = GPT(gpt_config("tiny", dropout=0.1, checkpoint_blocks=checkpoint_blocks))
            zp = {"activation_tier": {"device": "file", "path": os.path.join(root, f"ckpt-{rank}")}}
            runs.append(_train(model, _config(stage, "fp32", zp, {"cpu_checkpointing": cpu})))
        out.append(runs)
    return out


def test_activation_checkpointing_gradients_are_bitwise_identical(tmp_path):
    results = run_distributed(_checkpoint_job, 2, str(tmp_path))[0]
    for stage, (plain, *checkpointed) in zip((0, 3), results):
        assert plain["moved"] == checkpointed[0]["moved"] == 0
        assert checkpointed[1]["moved"] == 2 * 16 * 64 * 4 * 2, checkpointed[1]["moved"]  # 2 blocks' inputs
        for name, run in zip(("checkpointed", "checkpointed, cpu_checkpointing"), checkpointed):
            assert plain["losses"] == run["losses"], (stage, name)
            for a, b in zip(plain["grads"], run["grads"]):
                for i, (ga, gb) in enumerate(zip(a, b)):
                    assert torch.equal(ga, gb), f"stage {stage} {name}: group {i} gradient differs"


def test_checkpointing_warns_about_what_it_cannot_do(caplog):
    cfg = _config(0, "fp32", {}, {"partition_activations": True, "number_checkpoints": 4})
    log = logging.getLogger("zeroplus")  # (it does not propagate: its own handler prints the rank)
    log.addHandler(caplog.handler)
    try:
        zeroplus.initialize(_model("gpt"), dict(cfg, gradient_accumulation_steps=1))
    finally:
        log.removeHandler(caplog.handler)
    assert "partition_activations" in caplog.text and "number_checkpoints" in caplog.text
