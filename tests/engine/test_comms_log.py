"""Where the time and the bytes go: ``comms_logger`` and ``wall_clock_breakdown``.

A stack of ``ParityBlock`` s (no embedding, no frozen layer: every byte is the dense theory's) trains on 2
gloo ranks with both on. The communication log's bytes per optimizer step in the data group equal the theory
of each stage (Ψ: the trained elements padded to the group, 4 bytes each in fp32): stage 0 all-reduces Ψ
(bus traffic 2Ψ); stages 1-2 reduce-scatter Ψ and all-gather Ψ (2Ψ); stage 3 all-gathers Ψ in forward and Ψ
in backward and reduce-scatters Ψ (3Ψ); besides, only scalars (norms, flags) are all-reduced. At ZeRO-2, rank
1 sleeps 0.2 s before each backward: rank 0's breakdown puts that wait in ``bwd_allreduce`` (inside
``bwd``), rank 1's does not, and the log names rank 1 as the straggler (the rank the others waited for).
``deepspeed.comm.log_summary()`` prints the same table. Under Ulysses (context 2) the context group's
all-to-all bytes per step are 9·L·b·s·h/C (4 per layer in forward, 5 in backward). Ranks per node come from
``zeroplus.node_size``, else the launch's ``LOCAL_WORLD_SIZE``, else one node (the comms log's split by link).
"""
from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import DIM, ParityBlock
from zeroplus.deepspeed_api import comm as deepspeed_comm
from zeroplus.models import GPT, gpt_config

STEPS = 4


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ParityBlock() for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y)


def _job(stage: int, sleep: float) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "wall_clock_breakdown": True, "steps_per_print": STEPS, "comms_logger": {"enabled": True},
           "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(_Stack(), cfg)
    data = torch.Generator().manual_seed(rank)

    def step() -> None:
        loss = engine(torch.randn(2, 4, DIM, generator=data), torch.randn(2, 4, DIM, generator=data))
        if sleep and rank == 1:
            time.sleep(sleep)
        engine.backward(loss)
        engine.step()
    step()  # the first step's one-off collectives stay out of the count
    engine.comms_log.reset()
    for _ in range(STEPS):
        step()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        deepspeed_comm.log_summary()
    padded = sum(g.shard_numel * g.dp.size for g in engine.partition.groups)
    out = {"bytes": engine.comms_log.bytes_by_kind(), "padded_bytes": 4 * padded, "timers": engine.timers.last,
           "summary": engine.comms_summary(), "printed": printed.getvalue()}
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_bytes_per_step_are_the_theory_of_the_stage(stage):
    got = run_distributed(_job, 2, stage, 0.0)[0]
    per_step = {kind: n / STEPS for kind, n in got["bytes"].items()}
    psi = got["padded_bytes"]
    gathers = {0: 0, 1: psi, 2: psi, 3: 2 * psi}[stage]
    assert per_step.get("all_gather", 0) == gathers, (stage, per_step, psi)
    assert per_step.get("reduce_scatter", 0) == (psi if stage else 0), (stage, per_step, psi)
    scalars = per_step.get("all_reduce", 0) - (psi if stage == 0 else 0)
    assert 0 <= scalars <= 64, (stage, per_step, psi)  # norms and flags
    assert got["timers"]["fwd"] > 0 and got["timers"]["step"] > 0 and got["timers"]["bwd"] > 0
    if stage == 3:
        assert got["timers"]["gather_wait"] > 0


def test_the_breakdown_puts_a_late_rank_in_the_reduction_wait_and_names_it_the_straggler():
    ranks = run_distributed(_job, 2, 2, 0.2)
    early, late = ranks[0]["timers"], ranks[1]["timers"]
    assert set(early) == {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "gather_wait", "offload_wait"}
    assert early["bwd_allreduce"] > 150 and early["bwd"] >= early["bwd_allreduce"], early
    assert late["bwd_allreduce"] < 100, late
    assert abs(early["bwd_inner"] - (early["bwd"] - early["bwd_allreduce"])) < 1e-6
    assert "straggler: rank 1" in ranks[0]["summary"], ranks[0]["summary"]
    assert ranks[0]["printed"].strip() == ranks[0]["summary"].strip() and ranks[1]["printed"] == ""
    assert "reduce_scatter" in ranks[0]["summary"] and "busbw GB/s" in ranks[0]["summary"]


def _ulysses() -> dict:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}, "comms_logger": {"enabled": True},
           "zeroplus": {"log_level": "warning", "memory_estimate": False,
                        "parallel": {"context": 2, "context_mode": "ulysses"}}}
    shape = gpt_config("tiny", n_head=4, block_size=32)
    engine = zeroplus.initialize(GPT(shape), cfg)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(ids, ids.roll(-1, 1)))
    engine.step()
    engine.comms_log.reset()
    for _ in range(STEPS):
        engine.backward(engine(ids, ids.roll(-1, 1)))
        engine.step()
    row = engine.comms_log.rows[("all_to_all", "context")]
    engine.destroy()
    return {"bytes": row.nbytes, "layers": shape.n_layer, "hidden": shape.n_embd}


def test_ulysses_moves_the_theorys_bytes_in_the_context_group():
    """Ulysses (context 2, a batch of 2 sequences of 32 tokens): per layer, forward exchanges q, k, v and the
    output (4 all-to-alls of b·s·h/C elements each), backward their inverses plus the output formed again
    (5, ``parallel/ulysses_output.py``): 9·L·b·s·h/C elements per step, fp32."""
    got = run_distributed(_ulysses, 2)[0]
    per_message = 2 * 32 * got["hidden"] // 2 * 4
    assert got["bytes"] / STEPS == 9 * got["layers"] * per_message, got


def test_nodes_come_from_the_config_else_the_launch_else_one_node(monkeypatch):
    from zeroplus.config import load_config, resolved
    from zeroplus.parallel.groups import ranks_per_node as node_size

    def nodes(block: dict) -> int:
        return node_size(resolved(load_config({"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
                                               "gradient_accumulation_steps": 1, "zeroplus": block})))

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert nodes({"node_size": 2}) == 2 and nodes({}) == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert nodes({}) == 1  # (no process group here: one rank, one node)
