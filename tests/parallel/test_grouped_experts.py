"""Stacked experts (``zeroplus/parallel/grouped_experts.py``) against their reference twin and against ``MoE``'s
per-expert modules.

- ``GroupedExperts`` (GELU, ReLU, SwiGLU; with and without biases) equals ``expert_loop`` (each expert with
  ``F.linear``), values and every gradient, within fp32 rounding (bit for bit on this CPU at these sizes).
- ``MoE`` with a ``GroupedFFN`` equals ``MoE`` with the same experts as ``nn.Sequential(Linear, GELU, Linear)``
  modules (weights copied in): outputs, balancing loss, input, gate and expert gradients, with dropped tokens.
- The GPT with ``moe_grouped`` trains through ``initialize`` at ZeRO-3 as the GPT with module experts, weights
  copied (losses to fp32 rounding); expert parallelism over 2 ranks is in ``test_moe.py``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroplus
from zeroplus.models.gpt import GPT, gpt_config
from zeroplus.parallel.grouped_experts import GroupedExperts, GroupedFFN, expert_loop
from zeroplus.parallel.groups import SingleRank
from zeroplus.parallel.moe import MoE, is_expert

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_experts_equal_the_loop_over_experts(activation: str, bias: bool) -> None:
    torch.manual_seed(0)
    experts = GroupedExperts(3, 9, GroupedFFN(13, activation, bias))  # type: ignore[arg-type]
    x = torch.randn(3, 7, 9, requires_grad=True)
    out = experts(x)
    grad = torch.randn_like(out)
    inputs = [x, *experts.parameters()]
    got = torch.autograd.grad(out, inputs, grad)
    ref_out = expert_loop(experts, x)
    ref = torch.autograd.grad(ref_out, inputs, grad)
    torch.testing.assert_close(out, ref_out)
    for name, a, b in zip(["x", *(n for n, _ in experts.named_parameters())], got, ref):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{activation}, bias {bias}: {n}: {m}")


def test_grouped_ffn_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ValueError, match="activation.*'tanh'"):
        GroupedFFN(8, "tanh")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ffn must be positive, got 0"):
        GroupedFFN(0)


def _copy_into(grouped: GroupedExperts, modules: nn.ModuleList) -> None:
    with torch.no_grad():
        for i, m in enumerate(modules):
            grouped.w_in[i].copy_(m[0].weight.t())
            grouped.b_in[i, 0].copy_(m[0].bias)
            grouped.w_out[i].copy_(m[2].weight.t())
            grouped.b_out[i, 0].copy_(m[2].bias)


def test_moe_with_stacked_experts_equals_moe_with_expert_modules() -> None:
    torch.manual_seed(0)
    modules = MoE(8, lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), 4, k=2,
                  capacity_factor=1.0, ep=SingleRank())
    grouped = MoE(8, GroupedFFN(16, "gelu", bias=True), 4, k=2, capacity_factor=1.0, ep=SingleRank())
    grouped.gate.load_state_dict(modules.gate.state_dict())
    _copy_into(grouped.experts, modules.experts)
    assert all(is_expert(p) for p in grouped.experts.parameters()) and not is_expert(grouped.gate.wg.weight)
    x = torch.randn(24, 8)
    w = torch.randn(24, 8)
    results = []
    for moe in (modules, grouped):
        xi = x.clone().requires_grad_()
        y, aux = moe(xi)
        ((y * w).sum() + aux).backward()
        results.append((y, aux, xi.grad, moe.gate.wg.weight.grad))
    assert int((grouped.gate(x)[1] < 0).sum()) > 0, "no choice was dropped: the capacity path is untested"
    for name, a, b in zip(["y", "aux", "x grad", "gate grad"], results[0], results[1]):
        torch.testing.assert_close(b, a, msg=lambda m, n=name: f"{n}: {m}")
    for i, m in enumerate(modules.experts):
        torch.testing.assert_close(grouped.experts.w_in.grad[i], m[0].weight.grad.t(), msg=f"expert {i} in")
        torch.testing.assert_close(grouped.experts.b_out.grad[i, 0], m[2].bias.grad, msg=f"expert {i} out bias")


def _gpt_losses(grouped: bool, source: GPT | None = None) -> tuple[list[float], GPT]:
    torch.manual_seed(0)
    cfg = gpt_config("tiny", moe_experts=4, moe_k=2, moe_grouped=grouped)
    model = GPT(cfg)
    if source is not None:  # the module experts' weights, stacked
        model.load_state_dict({n: t for n, t in source.state_dict().items() if ".experts." not in n}, strict=False)
        for block, ref in zip(model.blocks, source.blocks):
            experts = block.mlp.moe.experts
            with torch.no_grad():
                for i, m in enumerate(ref.mlp.moe.experts):
                    experts.w_in[i].copy_(m.fc.weight.t())
                    experts.b_in[i, 0].copy_(m.fc.bias)
                    experts.w_out[i].copy_(m.proj.weight.t())
                    experts.b_out[i, 0].copy_(m.proj.bias)
    kept = GPT(cfg)
    kept.load_state_dict(model.state_dict())
    engine = zeroplus.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                         "zeroplus": {"log_level": "warning", "memory_estimate": False}})
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses, kept


def test_gpt_with_stacked_experts_trains_as_with_expert_modules() -> None:
    plain, source = _gpt_losses(False)
    grouped, _ = _gpt_losses(True, source)
    torch.testing.assert_close(torch.tensor(grouped), torch.tensor(plain), rtol=1e-6, atol=0)
