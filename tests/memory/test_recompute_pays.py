"""Resize recompute left unset runs only where it takes at least 1% off the predicted peak of the steps (see note:
recompute where it pays).

The estimate: with the key unset, the budget is the one with the technique off (``stood_down`` names it) where it
takes nothing off the peak (GPT tiny at 2 x 16: the peak is the model states), and the one with it on where it
takes enough (4 x 64 and more: activations). The engine, one rank: its first forward reads that choice, so the
technique stands down before it records anything (no bytes dropped, no saved-tensor hooks, no hook left on the
blocks, the engine's choice says off and why while its config stays as resolved: frozen), or stays on and drops its
outputs; either way the losses equal the run with the key written out to match, bit for bit, and the run is measured
against the budget it runs.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.same_budget import assert_same_phases
from zeroplus import initialize_engine
from zeroplus.budget.estimate import RECOMPUTE, recompute_pays
from zeroplus.budget.runtime_overhead import second_simulation_bytes
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config

SMALL, LARGE = (2, 16), (4, 64)  # micro-batch x sequence: model states' peak, activations' peak


def _config(micro: int, recompute: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
            "zeroplus": {"resize_recompute": recompute}}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", block_size=64))


def test_recompute_pays_is_a_share_of_the_peak():
    assert recompute_pays(10, 1000) and not recompute_pays(9, 1000)


@pytest.mark.parametrize("shape", [SMALL, LARGE])
def test_the_estimate_keeps_an_unset_recompute_only_where_it_lowers_the_peak(shape):
    micro, seq = shape
    budgets = {name: zeroplus.estimate(_model, _config(micro, block), world_size=1, seq_len=seq)
               for name, block in (("unset", {}), ("on", {"enabled": True}), ("off", {"enabled": False}))}
    pays = budgets["off"].steps_peak_bytes - budgets["on"].steps_peak_bytes
    assert (pays == 0) if shape == SMALL else (pays >= 0.01 * budgets["on"].steps_peak_bytes), pays
    chosen = budgets["off"] if shape == SMALL else budgets["on"]
    assert budgets["unset"].phases == _with_second_simulation(chosen.phases, shape == LARGE)
    # where it stands down, the budget names at most what it would take off: what the run without it holds for backward
    # at its peak, which bounds the effect (0 here) without simulating the run with it
    said = budgets["unset"].stood_down
    assert set(said) == ({RECOMPUTE} if shape == SMALL else set())
    if shape == SMALL:
        off = budgets["off"]
        assert pays <= said[RECOMPUTE] == off.phases[off.steps_peak_phase]["activation"]
        assert not recompute_pays(said[RECOMPUTE], off.steps_peak_bytes - said[RECOMPUTE])
    assert ("resize_recompute (on by default) is off" in str(budgets["unset"])) == (shape == SMALL)  # the table says
    assert budgets["on"].stood_down == budgets["off"].stood_down == {}  # written out: kept as written


def _with_second_simulation(phases: dict, simulated_twice: bool) -> dict:
    """``phases`` as an engine that simulated twice at its first forward holds them: the second simulation's residue
    (the runtime probe's ``second_simulation``) from the forward on (see note: recompute where it pays)."""
    kept = second_simulation_bytes("cpu") if simulated_twice else 0
    return {p: {**row, **({"runtime": row["runtime"] + kept, "total": row["total"] + kept} if p != "init" else {})}
            for p, row in phases.items()}


def _train(micro: int, seq: int, recompute: dict) -> dict:
    engine = zeroplus.initialize(_model(), _config(micro, recompute))
    g = torch.Generator().manual_seed(1)
    losses, dropped = [], []
    for _ in range(3):
        x = torch.randint(0, 256, (micro, seq), generator=g)
        loss = engine(x, x)
        dropped.append(engine.ledger.saved_bytes(RECOMPUTE, Category.ACTIVATION))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    block, choice = engine.config.zeroplus.resize_recompute, engine.choices[RECOMPUTE]
    budget = engine.budget
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in engine.module.modules())
    with pytest.raises(AttributeError, match="frozen"):
        block.enabled = not block.enabled
    return {"losses": losses, "dropped": dropped, "enabled": choice.on, "why": choice.why,
            "as_resolved": (block.enabled, block.by_default), "hooks": hooks,
            "claimers": len(engine.activations.claimers),
            "stood_down": budget.stood_down if budget else None, "phases": budget.phases if budget else None}


@pytest.mark.parametrize("shape", [SMALL, LARGE])
def test_the_engine_runs_an_unset_recompute_as_its_budget_chose(shape):
    unset = run_distributed(_train, 1, *shape, {})[0]
    written = run_distributed(_train, 1, *shape, {"enabled": shape == LARGE})[0]
    assert unset["losses"] == written["losses"]  # bitwise: the same run
    assert_same_phases(unset["phases"], _with_second_simulation(written["phases"], shape == LARGE))  # what it runs
    assert unset["hooks"] == written["hooks"]  # stood down: its scope hooks on the blocks went with it
    assert unset["as_resolved"] == (True, True)  # the config as resolved: on by default, whatever ran
    if shape == SMALL:  # stood down at the first forward: nothing recorded, no hooks left
        assert (unset["enabled"], set(unset["stood_down"]), unset["claimers"]) == (False, {RECOMPUTE}, 0)
        assert "under 1%" in unset["why"], unset["why"]
        assert unset["dropped"] == [0, 0, 0]
    else:
        assert (unset["enabled"], unset["stood_down"], unset["claimers"]) == (True, {}, 1)
        assert all(d > 0 for d in unset["dropped"]) and unset["dropped"] == written["dropped"]


def _train_without_a_prediction_on_rank_1() -> dict:
    def no_prediction(*args, **kwargs):
        raise RuntimeError("no prediction on this rank")
    if torch.distributed.get_rank() == 1:
        initialize_engine.estimate = no_prediction  # (this worker process only)
    return _train(*SMALL, {})


def test_the_ranks_agree_and_one_without_a_prediction_keeps_it_on_everywhere():
    """Two ranks at SMALL both stand it down; when rank 1 has no prediction (its estimate raised), both keep it on,
    so the ranks run alike (one flag's all-reduce at the first forward)."""
    both = run_distributed(_train, 2, *SMALL, {})
    assert [(r["enabled"], r["claimers"], r["dropped"]) for r in both] == [(False, 0, [0, 0, 0])] * 2
    one = run_distributed(_train_without_a_prediction_on_rank_1, 2)
    assert [(r["enabled"], r["claimers"]) for r in one] == [(True, 1)] * 2
    assert [r["stood_down"] for r in one] == [{}, None]  # rank 0's table does not say off; rank 1 has no budget
    assert all(d > 0 for r in one for d in r["dropped"])
