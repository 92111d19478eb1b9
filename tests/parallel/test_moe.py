"""Mixture of experts over 2 expert-parallel ranks against the same layer with every expert in one process.

Each rank routes its own 12 tokens (top-2 of 4 experts, capacity 6: some choices are dropped) through
the two experts it holds and the two on the other rank, by all-to-all. The reference is ``MoE`` with a
one-rank expert group (all 4 experts local) on each rank's tokens in turn. Checked: outputs, the
load-balancing loss, the input gradients and the gate's gradient per rank, and each expert's gradient
(the reference's summed over both ranks' tokens, since every rank's tokens reach it), in fp32 to 1e-5;
and that routing did drop tokens (so the capacity path runs). The same with stacked experts (``GroupedFFN``,
one batched product over each rank's experts: the slots from both ranks reordered expert-major).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_helper import run_distributed
from zeroplus.parallel.grouped_experts import GroupedFFN
from zeroplus.parallel.groups import SingleRank, init_parallel
from zeroplus.parallel.moe import MoE, is_expert
from zeroplus.parallel.topology import Topology

DIM, TOKENS, EXPERTS = 8, 12, 4


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM))


def _full(grouped: bool = False) -> MoE:
    torch.manual_seed(0)
    return MoE(DIM, GroupedFFN(16, "gelu", bias=True) if grouped else _expert, EXPERTS, k=2, capacity_factor=1.0,
               ep=SingleRank())


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def _run(moe: MoE, rank: int) -> dict:
    x, w = _tokens(rank)
    x.requires_grad_()
    y, aux = moe(x)
    ((y * w).sum() + aux).backward()
    _, slot, *_ = moe.gate(x.detach())
    return {"y": y.detach(), "aux": aux.item(), "x_grad": x.grad, "gate_grad": moe.gate.wg.weight.grad.clone(),
            "expert_grads": {moe.first_expert + i: [p.grad[i].clone() for p in moe.experts.parameters()]
                             for i in range(moe.local)} if moe.grouped else
                            {moe.first_expert + i: [p.grad.clone() for p in e.parameters()]
                             for i, e in enumerate(moe.experts)},
            "dropped": int((slot < 0).sum())}


def _expert_parallel(grouped: bool) -> dict:
    groups = init_parallel(Topology(2, expert=2))
    full = _full(grouped)
    torch.manual_seed(0)
    moe = MoE(DIM, GroupedFFN(16, "gelu", bias=True) if grouped else _expert, EXPERTS, k=2, capacity_factor=1.0,
              ep=groups.expert)
    moe.gate.load_state_dict(full.gate.state_dict())
    if grouped:  # this rank's slice of the stacked weights
        with torch.no_grad():
            for p, q in zip(moe.experts.parameters(), full.experts.parameters()):
                p.copy_(q[moe.first_expert:moe.first_expert + moe.local])
    else:
        for i, e in enumerate(moe.experts):
            e.load_state_dict(full.experts[moe.first_expert + i].state_dict())
    assert all(is_expert(p) for p in moe.experts.parameters()) and not is_expert(moe.gate.wg.weight)
    return _run(moe, groups.expert.rank)


@pytest.mark.parametrize("grouped", [False, True], ids=["modules", "stacked"])
def test_expert_parallel_moe_matches_all_experts_in_one_process(grouped: bool):
    ranks = run_distributed(_expert_parallel, 2, grouped)
    reference = []
    for rank in range(2):
        full = _full(grouped)
        reference.append(_run(full, rank))
    assert sum(r["dropped"] for r in reference) > 0, "no choice was dropped: the capacity path is untested"
    for rank, got in enumerate(ranks):
        ref = reference[rank]
        torch.testing.assert_close(got["y"], ref["y"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: output")
        assert abs(got["aux"] - ref["aux"]) < 1e-6, f"rank {rank}: load-balancing loss"
        torch.testing.assert_close(got["x_grad"], ref["x_grad"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: dx")
        torch.testing.assert_close(got["gate_grad"], ref["gate_grad"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: gate")
        for e, grads in got["expert_grads"].items():  # every rank's tokens reach expert e
            summed = [a + b for a, b in zip(reference[0]["expert_grads"][e], reference[1]["expert_grads"][e])]
            for g, s in zip(grads, summed):
                torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: expert {e}")
