"""Dropless experts and lending the hot ones (``zeroplus/parallel/dropless_moe.py``) against one process.

Two gloo ranks split 4 experts (top-2, small MLPs); the routing is skewed on purpose (every token carries a
feature the gate weighs towards expert 0, so expert 0 gets most of the first choices). The reference is the
same layer in one process holding every expert, run on each rank's tokens, the loss the sum of the ranks'. On
each rank, routed (``hot_experts`` 0) and with the hottest expert lent (``hot_experts`` 1: expert 0, checked):
the outputs, the balancing loss, the gate's gradient (summed over the ranks, as a data-parallel gradient is)
and every local expert's parameter gradients equal the reference's within 1e-5. Lending moves expert 0's
tokens out of the all-to-alls and its parameters into a broadcast: the counted bytes say so. Refused: a
``hot_experts`` not below ``num_experts``, an expert that is not a factory.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroplus
from tests.dist_helper import run_distributed
from zeroplus.comm import DataParallelGroup
from zeroplus.parallel.dropless_moe import DroplessMoE

DIM, E, K, TOKENS = 8, 4, 2, 12


class _OneRank(DataParallelGroup):
    """This process alone (the reference layer holds every expert, inside the distributed run too)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.rank, self.size = 0, 1


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 16), nn.GELU(), nn.Linear(16, DIM))


def _layer(hot: int = 0, ep: DataParallelGroup | None = None) -> DroplessMoE:
    torch.manual_seed(0)
    layer = DroplessMoE(DIM, _expert, E, k=K, hot_experts=hot, ep=ep if ep is not None else _OneRank())
    with torch.no_grad():
        layer.gate.weight[0, 0] += 2.0  # feature 0 pulls towards expert 0
    return layer


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, DIM, generator=g)
    x[:, 0] = 3.0
    return x, torch.randn(TOKENS, DIM, generator=g)


def _loss(layer: DroplessMoE, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, target = _tokens(rank)
    y, aux = layer(x)
    return (y * target).sum() + 0.1 * aux, y, aux


def _sharded(hot: int) -> dict:
    groups = zeroplus.init_parallel({"zeroplus": {"parallel": {"expert": 2}}})
    rank, ep = torch.distributed.get_rank(), groups.expert
    whole = _layer()  # every expert, to copy this rank's from
    layer = _layer(hot, ep)
    with torch.no_grad():
        layer.gate.weight.copy_(whole.gate.weight)
        for i in range(layer.local):
            layer.experts[i].load_state_dict(whole.experts[layer.first_expert + i].state_dict())
    ep.bytes_sent.clear()
    loss, y, aux = _loss(layer, rank)
    loss.backward()
    gate = layer.gate.weight.grad.clone()
    torch.distributed.all_reduce(gate)
    experts = {f"{layer.first_expert + i}.{n}": p.grad.clone() for i in range(layer.local)
               for n, p in layer.experts[i].named_parameters()}
    return {"y": y.detach(), "aux": aux.item(), "gate": gate, "experts": experts, "hot": layer.last_hot,
            "bytes": dict(ep.bytes_sent)}


def _reference() -> tuple[list[torch.Tensor], list[float], torch.Tensor, dict]:
    layer = _layer()
    ys, auxes, total = [], [], 0.0
    for rank in range(2):
        loss, y, aux = _loss(layer, rank)
        total = total + loss
        ys.append(y.detach())
        auxes.append(aux.item())
    total.backward()
    experts = {f"{i}.{n}": p.grad for i in range(E) for n, p in layer.experts[i].named_parameters()}
    return ys, auxes, layer.gate.weight.grad, experts


@pytest.fixture(scope="module")
def runs() -> dict:
    return {hot: run_distributed(_sharded, 2, hot) for hot in (0, 1)}


@pytest.mark.parametrize("hot", [0, 1])
def test_dropless_experts_routed_or_lent_equal_one_process(runs, hot):
    reference = _reference()
    for rank, got in enumerate(runs[hot]):
        _assert_equal(got, reference, rank, hot, f"hot_experts {hot}, rank {rank}")


def _assert_equal(got: dict, reference: tuple, data_rank: int, hot: int, where: str) -> None:
    """One rank's output, balancing loss, gate and expert gradients against the reference's for its data rank."""
    ys, auxes, gate, experts = reference
    assert got["hot"] == ([0] if hot else []), where
    torch.testing.assert_close(got["y"], ys[data_rank], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: output {m}")
    assert got["aux"] == pytest.approx(auxes[data_rank], rel=1e-6), where
    torch.testing.assert_close(got["gate"], gate, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: gate {m}")
    for name, grad in got["experts"].items():
        torch.testing.assert_close(grad, experts[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{where}: expert {n} {m}")


def _expert_data_mode() -> list[dict]:
    """4 ranks, tensor 2 x data 2, expert 4 over data x tensor: each tensor group shares its data rank's tokens,
    and each of its ranks routes half of them (``expert_tokens.py``); routed, then with expert 0 lent."""
    groups = zeroplus.init_parallel({"zeroplus": {"parallel": {"tensor": 2, "expert": 4, "experts_span_tensor": True}}})
    d = groups.data.rank
    out = []
    for hot in (0, 1):
        whole, layer = _layer(), _layer(hot, groups.expert)
        with torch.no_grad():
            layer.experts[0].load_state_dict(whole.experts[layer.first_expert].state_dict())
        loss, y, aux = _loss(layer, d)
        loss.backward()
        gate = layer.gate.weight.grad.clone()  # summed over the tensor ranks' halves; now over the data ranks
        groups.data.all_reduce(gate).wait()
        out.append({"y": y.detach(), "aux": aux.item(), "gate": gate, "data": d, "hot": layer.last_hot,
                    "experts": {f"{layer.first_expert}.{n}": p.grad.clone()
                                for n, p in layer.experts[0].named_parameters()}})
    return out


def test_dropless_experts_in_the_expert_data_mode_equal_one_process():
    """The reference as above (each data rank's tokens once); every rank's output is its data rank's whole
    output (gathered over its tensor group)."""
    reference = _reference()
    for rank, results in enumerate(run_distributed(_expert_data_mode, 4)):
        for hot, got in enumerate(results):
            _assert_equal(got, reference, got["data"], hot, f"expert-data mode, hot_experts {hot}, rank {rank}")


def test_lending_trades_the_hot_experts_tokens_for_its_parameters(runs):
    routed, lent = runs[0][0]["bytes"], runs[1][0]["bytes"]
    params = sum(p.numel() * 4 for p in _expert().parameters())
    assert "broadcast" not in routed and lent["broadcast"] == params
    assert lent["all_reduce"] >= params  # the gradients summed onto the owner (and the per-expert counts)
    assert lent["all_to_all"] < routed["all_to_all"]  # (the tokens' exchanges and the counts')


def _through_the_engine(stage: int, hot: int = 1) -> list[float]:
    """The layer (``hot`` experts lent) in a model through ``initialize`` at ZeRO ``stage`` (expert parameters
    over the expert-data group): its losses over 3 steps (lending at ZeRO-3 is refused)."""
    zeroplus.init_parallel({"zeroplus": {"parallel": {"expert": 2}}})
    rank = torch.distributed.get_rank()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = _layer(hot, zeroplus.parallel.groups.parallel_groups().expert)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            y, aux = self.moe(x)
            return ((y - target) ** 2).mean() + 0.1 * aux
    config = {"train_micro_batch_size_per_gpu": TOKENS, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "warning", "memory_estimate": False,
                                                                   "parallel": {"expert": 2}}}
    if stage == 3:
        with pytest.raises(zeroplus.config.ConfigError, match=r"lend their hot experts"):
            zeroplus.initialize(Model(), config)
        return []
    engine = zeroplus.initialize(Model(), config)
    losses = []
    for _ in range(3):
        loss = engine(*_tokens(rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def test_lending_trains_through_the_engine_as_routing_at_zero_2_and_is_refused_at_zero_3():
    routed, lent = run_distributed(_through_the_engine, 2, 2, 0), run_distributed(_through_the_engine, 2, 2, 1)
    for a, b in zip(routed, lent):
        assert len(b) == 3 and b[-1] < b[0], b
        assert b == pytest.approx(a, rel=1e-5), (a, b)
    run_distributed(_through_the_engine, 2, 3)


def test_bad_settings_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="hot_experts must be at least 0 and below num_experts = 4, got 4"):
        DroplessMoE(DIM, _expert, E, hot_experts=4)
    with pytest.raises(ValueError, match="takes an expert factory"):
        DroplessMoE(DIM, None, E)  # type: ignore[arg-type]
