"""Function modes enter only where they have something to do (see note: idle modes).

One rank, stage 1, the defaults (resize recompute with its functional watch, the lean loss), three steps. The
model reads the torch-function mode stack depth (``torch._C._len_torch_function_stack``) at the start of each
forward and where its head starts, after the blocks:

- loss taken outside the forward (the logits returned): both modes in the first forward, none from the second;
- loss in the forward, activation modules: the first forward has both from the start; from the second the
  functional watch is gone and the lean loss is entered only when the last block's forward ends, and still
  takes the loss each step;
- loss in the forward, ``F.gelu`` called in the blocks: the functional watch stays, so the lean loss is entered
  from the start every step (modes leave in stack order);
- a second loss taken between the blocks: the lean loss stays entered from the start (it would miss that call).

Every case's losses equal the engine's with both keys off, bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus
from zeroplus.kernels import cross_entropy_rows as rows_kernel

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

VOCAB, D = 64, 16


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks of 256 elements: these 16 x 64 logits span four, as a real LM's do (one block is left to torch)."""
    monkeypatch.setattr(rows_kernel, "BLOCK_ELEMENTS", 256)


class _Block(nn.Module):
    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.norm, self.fc, self.act = nn.LayerNorm(D), nn.Linear(D, D), nn.GELU()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.fc(self.norm(h))
        return h + (F.gelu(z) if self.functional else self.act(z))


class _Net(nn.Module):
    """Blocks and a head; ``loss``: "outside" (logits returned), "inside" (the loss in the forward) or "between"
    (a second loss after the first block too)."""

    def __init__(self, functional: bool, loss: str) -> None:
        super().__init__()
        self.loss = loss
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(_Block(functional) for _ in range(2))
        self.depths: list[tuple[int, int]] = []  # (at the forward's start, at the head)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        start = torch._C._len_torch_function_stack()
        h = self.emb(x)
        extra = 0
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 0 and self.loss == "between":
                extra = F.cross_entropy(self.head(h).view(-1, VOCAB), y.view(-1))
        self.depths.append((start, torch._C._len_torch_function_stack()))
        logits = self.head(h)
        if self.loss == "outside":
            return logits
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1)) + extra


def _train(functional: bool, loss: str, **keys: object) -> tuple[list[float], _Net, zeroplus.Engine]:
    torch.manual_seed(0)
    net = _Net(functional, loss)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, **keys}}
    engine = zeroplus.initialize(net, cfg)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)
        out = engine(x, y)
        value = F.cross_entropy(out.view(-1, VOCAB), y.view(-1)) if loss == "outside" else out
        engine.backward(value)
        engine.step()
        losses.append(value.item())
    return losses, net, engine


@pytest.mark.parametrize("functional,loss,depths,taken", [
    (False, "outside", [(2, 2), (0, 0), (0, 0)], 0),
    (False, "inside", [(2, 2), (0, 1), (0, 1)], 3),
    (True, "inside", [(2, 2), (2, 2), (2, 2)], 3),
    (False, "between", [(2, 2), (1, 1), (1, 1)], 6),
])
def test_modes_enter_only_where_they_act(functional: bool, loss: str, depths: list, taken: int):
    losses, net, engine = _train(functional, loss)
    assert net.depths == depths
    lean = engine.activations.around[0]
    assert lean.taken == taken and lean.idle == (taken == 0)
    assert engine.activations.waits_on_tail == (taken != 0)  # idle: the hook on the last block went too
    off, _, plain = _train(functional, loss, lean_cross_entropy=False, resize_recompute={"enabled": False})
    assert losses == off
    engine.destroy()
    plain.destroy()


def test_a_compiled_model_keeps_its_modes_as_in_the_first_forward():
    """TorchDynamo guards on the mode stack: for a model given compiled to ``initialize`` the lean loss is entered
    from the start of every forward, even when it takes nothing (no recompile), and no hook waits on the last
    block (it would break the whole-model graph)."""
    torch.manual_seed(0)
    net = torch.compile(_Net(False, "outside"), backend="eager")
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(net, cfg)
    router = engine.activations
    assert not router.waits_on_tail
    for _ in range(2):
        x, y = torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8))
        engine.backward(F.cross_entropy(engine(x, y).view(-1, VOCAB), y.view(-1)))
        engine.step()
    assert router.decided and not router.around[0].idle and not router.late_safe
    engine.destroy()
