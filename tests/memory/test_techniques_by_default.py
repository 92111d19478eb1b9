"""Memory techniques left unset run as the device's defaults say (see note: techniques by default).

``zeroplus.techniques_by_default``: ``"where_they_pay"`` (the CPU's ``"auto"``: the lean loss and embedding rows on,
resize recompute where it takes 1% off the peak) or ``"where_needed"`` (CUDA's and NPU's: each only where the run's
predicted peak without them passes 95% of the rank's memory, ``zeroplus.memory_budget`` or the device's). The
estimate: where the run fits without them its budget is the run with all three written off, named as not needed, up to
the capacity at which it would not fit, and from there the run with them. The engine, on two ranks: its first forward
reads that choice, so no technique touches a step (the lean loss takes no call, recompute drops nothing, no rows
function in the graph), its choices say off and why, and the losses equal the run with them written off bit for bit;
with a memory budget the run needs them under, the lean loss and the rows stay on. Keys written out are kept as
written.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.graph_nodes import graph_nodes
from tests.same_budget import assert_same_phases
from zeroplus.accelerator import Accelerator, get_accelerator, techniques_by_default
from zeroplus.budget.estimate import LEAN, NEEDED_FROM, RECOMPUTE, ROWS, default_policy
from zeroplus.config import ConfigError, parse_config
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config

MICRO, SEQ, VOCAB = 4, 128, 4096  # logits of 2^21 elements: past one block of the lean loss's rows on the CPU
NEEDED = {"techniques_by_default": "where_needed"}
OFF = {"lean_cross_entropy": False, "resize_recompute": {"enabled": False}, "embedding_rows": False}


def _config(zeroplus_block: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
            "zeroplus": zeroplus_block}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", block_size=SEQ, vocab_size=VOCAB))


def test_each_device_kind_names_its_defaults_and_this_host_its_memory():
    assert [techniques_by_default(k) for k in ("cpu", "cuda", "npu")] == ["where_they_pay", "where_needed",
                                                                           "where_needed"]
    with pytest.raises(ValueError, match="'tpu'"):
        techniques_by_default("tpu")
    assert default_policy(_config({}), "cpu") == "where_they_pay"  # "auto": the device's
    assert default_policy(_config({}), "cuda") == "where_needed"
    assert default_policy(_config(NEEDED), "cpu") == "where_needed"  # written out: as written
    with pytest.raises(ConfigError, match="'zeroplus.techniques_by_default'.*'always'"):
        parse_config(_config({"techniques_by_default": "always"}))
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < Accelerator().capacity_bytes(1) <= physical
    assert Accelerator().capacity_bytes(4) == Accelerator().capacity_bytes(1) // 4  # the host shared by its ranks


def test_where_needed_the_budget_is_the_run_without_them_until_it_would_not_fit():
    def budget(block: dict, capacity: int | None = None):
        return zeroplus.estimate(_model, _config(block), world_size=1, seq_len=SEQ, capacity=capacity)

    off, pay = budget(OFF), budget({})
    assert pay.steps_peak_bytes < 0.95 * off.steps_peak_bytes  # the activation regime: they take memory off
    fits = budget(NEEDED)  # this host's memory: far more than the run needs
    assert fits.phases == off.phases and fits.not_needed.keys() == {RECOMPUTE, LEAN, ROWS}
    assert "not needed" in fits.not_needed[LEAN] and "this host's over 1 rank(s)" in fits.not_needed[LEAN]
    assert "lean_cross_entropy (on by default) is off: not needed" in str(fits)  # the table says
    edge = math.ceil(off.training_peak_bytes / NEEDED_FROM)
    assert budget(NEEDED, edge).not_needed.keys() == {RECOMPUTE, LEAN, ROWS}
    needed = budget(NEEDED, edge - 2)  # a byte more than 95% of it: the run with them, as where they pay
    assert needed.phases == pay.phases and needed.not_needed == {}
    assert fits.caveats == [] and needed.caveats == []
    for seq in (SEQ, 2):  # (a device this machine does not have: its memory unknown here, and said, once)
        elsewhere = zeroplus.estimate(_model, _config({}), world_size=1, seq_len=seq, accelerator="cuda")
        assert (RECOMPUTE in elsewhere.stood_down) == (seq == 2)  # (at 2 tokens recompute does not pay)
        unknown = [c for c in elsewhere.caveats if "unknown on this machine; give zeroplus.memory_budget" in c]
        assert elsewhere.not_needed == {} and len(unknown) == 1, elsewhere.caveats
    written = budget({**NEEDED, "lean_cross_entropy": True})  # a key written out is kept
    assert written.not_needed.keys() == {RECOMPUTE, ROWS}
    assert written.phases == budget({"resize_recompute": {"enabled": False}, "embedding_rows": False}).phases


def _train(block: dict) -> dict:
    engine = zeroplus.initialize(_model(), _config(block))
    g = torch.Generator().manual_seed(1)
    losses, dropped, rows = [], [], []
    for _ in range(3):
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        loss = engine(x, x)
        rows.append("EmbeddingRowsIntoFlatBackward" in graph_nodes(loss))
        dropped.append(engine.ledger.saved_bytes(RECOMPUTE, Category.ACTIVATION))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "dropped": dropped, "rows": rows, "taken": [m.taken for m in engine.activations.around],
            "choices": {k: (c.on, c.why) for k, c in engine.choices.items()},
            "phases": engine.budget.phases, "not_needed": engine.budget.not_needed,
            "report": str(engine.memory_report())}


def test_the_engine_runs_without_them_where_not_needed_and_keeps_the_lean_loss_where_the_budget_needs_it():
    assert get_accelerator().name == "cpu"
    fits = run_distributed(_train, 2, NEEDED)
    off = run_distributed(_train, 2, OFF)
    tight = run_distributed(_train, 2, {**NEEDED, "memory_budget": "64MiB", "seq_len": SEQ})
    for rank in range(2):
        ran = fits[rank]
        assert ran["losses"] == off[rank]["losses"] == tight[rank]["losses"]  # bitwise: every technique is exact
        assert_same_phases(ran["phases"], off[rank]["phases"], f"rank {rank}")  # (two processes)
        assert ran["not_needed"].keys() == {RECOMPUTE, LEAN, ROWS}
        assert (ran["taken"], ran["dropped"], ran["rows"]) == ([0], [0, 0, 0], [False] * 3)  # none touched a step
        assert "lean_cross_entropy (on by default) is off: not needed" in ran["report"]  # memory_report() says
        for technique in (RECOMPUTE, LEAN, ROWS):
            on, why = ran["choices"][technique]
            assert not on and "not needed" in why and "over 2 rank(s)" in why, why
        # 64 MiB: the run without them (63.7 MiB predicted) passes 95% of it, with the lean loss it fits (the planner
        # resolves recompute's key within the budget)
        assert tight[rank]["taken"] == [3] and tight[rank]["choices"][LEAN][0] and tight[rank]["rows"] == [True] * 3
        assert tight[rank]["not_needed"] == {}
