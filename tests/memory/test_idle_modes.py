"""Function modes that find nothing to do in a model's forwards stop being entered (see note: idle modes).

One rank, stage 1, the defaults (resize recompute with its functional watch, the lean loss). Each forward's
torch-function mode stack is read from inside the model (``torch._C._len_torch_function_stack``):

- a model that returns logits, its loss taken outside: both modes run in the first step's forward and none from
  the second; the losses are those of the engine with both keys off, bit for bit;
- a model whose forward calls ``F.cross_entropy`` and ``F.gelu`` itself: both modes stay on every forward, and
  the lean loss still takes the call each step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

VOCAB, D = 64, 16


class _Net(nn.Module):
    """Two blocks (``functional``: ``F.gelu`` called in the block's forward, else an ``nn.GELU`` module) and a head;
    with targets the loss in the forward, else the logits returned. Records the mode stack depth per forward."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.fcs = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.act = nn.GELU()
        self.depths: list[int] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        self.depths.append(torch._C._len_torch_function_stack())
        h = self.emb(x)
        for norm, fc in zip(self.norms, self.fcs):
            z = fc(norm(h))
            h = h + (F.gelu(z) if self.functional else self.act(z))
        logits = self.head(h)
        return logits if y is None else F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def _train(functional: bool, loss_inside: bool, **keys: object) -> tuple[list[float], _Net, zeroplus.Engine]:
    torch.manual_seed(0)
    net = _Net(functional)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, **keys}}
    engine = zeroplus.initialize(net, cfg)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)
        loss = engine(x, y) if loss_inside else F.cross_entropy(engine(x).view(-1, VOCAB), y.view(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, net, engine


def test_modes_with_nothing_to_do_are_not_entered_after_the_first_step():
    losses, net, engine = _train(False, loss_inside=False)
    assert net.depths[0] == 2 and net.depths[1:] == [0, 0], net.depths  # lean loss and the functional watch
    off, _, plain = _train(False, loss_inside=False, lean_cross_entropy=False, resize_recompute={"enabled": False})
    assert losses == off
    engine.destroy()
    plain.destroy()


def test_modes_with_calls_to_take_stay_on_every_forward():
    losses, net, engine = _train(True, loss_inside=True)
    assert net.depths == [2, 2, 2], net.depths
    lean = engine._activations.around[0]
    assert lean.taken == 3 and not lean.idle
    recompute = next(c for c in engine._activations.claimers if type(c).__name__ == "ResizeRecompute")
    assert recompute.functions and recompute._functional_seen > 0
    off, _, plain = _train(True, loss_inside=True, lean_cross_entropy=False, resize_recompute={"enabled": False})
    assert losses == off
    engine.destroy()
    plain.destroy()
