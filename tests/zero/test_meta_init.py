"""A model built on the meta device gets, from ``initialize``, exactly the values a normal build under the
same seed has: torch's standard layers by replaying ``reset_parameters()``, Hugging Face Llama and GPT-2
(whose ``Conv1D`` draws in ``__init__``) by building them again under ``zeroplus.Init``; at ZeRO stages
0-3 on 1, 2 and 4 ranks. What cannot be initialised is an error naming it."""
from __future__ import annotations

import torch
from torch import nn

import zeroplus
from tests.dist_helper import run_distributed
from tests.hf_models import build
from tests.models import train_losses


class Layers(nn.Module):
    """torch's standard layers, one of each kind, plus a buffer reset_parameters() does not set."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 24)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 24))
                                    for _ in range(3))
        self.norm = nn.RMSNorm(24)
        self.head = nn.Linear(24, 64, bias=False)
        self.register_buffer("scale", torch.full((24,), 0.5))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x) * self.scale
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))


def _scale(module: nn.Module) -> None:
    if isinstance(module, Layers):
        module.scale.fill_(0.5)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            "zeroplus": {"memory_estimate": False, "log_level": "error"}}


MAKERS = {"layers": Layers, "llama": lambda: build("llama", "tiny"), "gpt2": lambda: build("gpt2", "tiny")}


def _case(family: str, stage: int) -> dict:
    torch.manual_seed(0)
    whole = MAKERS[family]()
    engine = zeroplus.initialize(whole, _config(stage))
    expected = {k: v.clone() for k, v in whole.state_dict().items()}
    expected_losses = train_losses(engine, hugging_face=family != "layers", vocab=64, seq=12, seed=3)
    engine.destroy()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MAKERS[family]()
    engine = zeroplus.initialize(model, _config(stage), init_fn=_scale if family == "layers" else None)
    got = model.state_dict()
    tied = family != "gpt2" or model.lm_head.weight is model.transformer.wte.weight
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]  # before training moves them
    losses = train_losses(engine, hugging_face=family != "layers", vocab=64, seq=12, seed=3)
    return {"differ": differ, "n": len(expected), "losses": (expected_losses, losses), "tied": tied}


def _cases(cases: list[tuple[str, int]]) -> list[dict]:
    return [_case(family, stage) for family, stage in cases]


def _check(cases: list[tuple[str, int]], world: int) -> None:
    for results in run_distributed(_cases, world, cases):
        _check_results(cases, results, world)


def _check_results(cases: list[tuple[str, int]], results: list[dict], world: int) -> None:
    for case, r in zip(cases, results):
        assert r["n"] > 0 and r["differ"] == [], (case, world, r["differ"])
        assert r["losses"][0] == r["losses"][1], (case, world)
        assert r["tied"], case


TWO_RANKS = [("layers", 0), ("layers", 3), ("llama", 3), ("gpt2", 1)]


def _two_rank_job() -> tuple[list[dict], dict]:
    return _cases(TWO_RANKS), _errors()


def test_meta_models_equal_normal_builds_and_what_cannot_be_initialised_is_named():
    for results, errors in run_distributed(_two_rank_job, 2):
        _check_results(TWO_RANKS, results, 2)
        assert "['1.w'] were written by no reset_parameters() and no init_fn" in errors["unwritten"]
        assert "score.weight" in errors["changed"] and "built from its config" in errors["changed"]
    _check([("layers", 2)], 4)
    _check_results([("layers", 1), ("gpt2", 3)], _cases([("layers", 1), ("gpt2", 3)]), 1)  # one rank, in process


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))


def _errors() -> dict:
    out = {}
    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(4, 4), NoReset())
    try:
        zeroplus.initialize(bare, _config(3))
    except ValueError as err:
        out["unwritten"] = str(err)
    with torch.device("meta"):
        llama = build("llama", "tiny")
    llama.score = nn.Linear(64, 2, device="meta")  # added after construction: not in a build from the config
    try:
        zeroplus.initialize(llama, _config(3))
    except ValueError as err:
        out["changed"] = str(err)
    return out
