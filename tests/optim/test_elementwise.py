"""Optimizers whose math depends on a parameter's shape are refused (``zeroplus/optim/build.py``).

zeroplus steps flat shards cut across parameters at every stage. Transformers' Adafactor (the Trainer's
``--optim adafactor``: second moments factored over rows and columns) stepped on them trained a model 0.078 away
from one process after 3 steps without a word; torch's Muon stopped inside torch; bitsandbytes' 8-bit optimizers
quantize states in blocks a shard cuts elsewhere. Each, as a client optimizer or by name in the config, is refused
at ``initialize`` on every rank, naming the class and what to do, with the model left as it was; torch's
element-wise classes (and a subclass keeping their step) still train, and ``zeroplus.elementwise_optimizer``
lets a user vouch for a class of their own.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import zeroplus
from tests.dist_helper import run_distributed


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _client(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    if name == "Adafactor":
        return transformers.optimization.Adafactor(params, lr=0.02, relative_step=False, scale_parameter=False)
    if name == "Muon":
        return torch.optim.Muon([p for p in params if p.dim() == 2], lr=0.02)
    if name == "AdamW8bit":
        import bitsandbytes as bnb
        return bnb.optim.AdamW8bit(params, lr=0.02)
    if name in ("AdamW", "declared"):
        return torch.optim.AdamW(params, lr=0.02)
    return None  # by name in the config


def _try(cases: list[tuple[str, int]]) -> list[str]:
    out = []
    for name, stage in cases:
        model = _mlp()
        before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                  "zeroplus": {"log_level": "warning", "memory_estimate": False,
                               "elementwise_optimizer": name == "declared"}}
        if name == "config-Adafactor":
            config["optimizer"] = {"type": "Adafactor", "params": {"lr": 0.02}}
        optimizer = _client(name, list(model.parameters()))
        try:
            engine = zeroplus.initialize(model, config, optimizer=optimizer)
        except zeroplus.ConfigError as err:
            untouched = all(p is q and torch.equal(p.detach(), v) for n, (q, v) in before.items()
                            for m, p in model.named_parameters() if m == n)
            out.append(f"{err}" + ("" if untouched else " [MODEL CHANGED]"))
            continue
        x = torch.randn(2, 8)
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.destroy()
        out.append("trained")
    return out


REFUSED = [("Adafactor", 1, "transformers.optimization.Adafactor"), ("Adafactor", 3, "Adafactor"),
           ("Muon", 1, "torch.optim._muon.Muon.step"),
           ("config-Adafactor", 2, "config key 'optimizer.type' ('Adafactor')")]


def test_shape_dependent_optimizers_are_refused_on_every_rank_and_elementwise_ones_train():
    pytest.importorskip("bitsandbytes")
    cases = [(n, s) for n, s, _ in REFUSED] + [("AdamW8bit", 2), ("AdamW", 3), ("declared", 1)]
    for rank, got in enumerate(run_distributed(_try, 2, cases)):
        for (name, stage, named), message in zip(REFUSED, got):
            assert named in message and f"rank {rank}" in message and "elementwise_optimizer" in message \
                and "[MODEL CHANGED]" not in message, f"rank {rank} {name} stage {stage}: {message}"
        assert "bitsandbytes.optim.adamw.AdamW8bit" in got[len(REFUSED)], got[len(REFUSED)]
        assert got[len(REFUSED) + 1:] == ["trained", "trained"], got
