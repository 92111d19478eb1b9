"""``zeroplus.eager.in_backward``: the one private torch call zeroplus makes to tell a checkpoint replay from a
forward. Covers: False in a forward and between steps, True in a tensor hook during backward and in a module's
forward replayed by ``torch.utils.checkpoint``; a torch release that changes the private call fails here."""
from __future__ import annotations

import torch
import torch.utils.checkpoint

from zeroplus.eager import in_backward


def test_in_backward_tells_a_checkpoint_replay_from_the_forward():
    seen: list[bool] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(in_backward())
            return self.linear(x)

    probe = Probe()
    x = torch.randn(2, 4, requires_grad=True)
    assert not in_backward()
    y = torch.utils.checkpoint.checkpoint(probe, x, use_reentrant=False)
    y.register_hook(lambda g: seen.append(in_backward()))
    y.sum().backward()
    assert seen == [False, True, True]  # the forward, the gradient hook, the replay
    assert not in_backward()
