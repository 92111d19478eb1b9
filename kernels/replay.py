"""Gradients of a function run again under autograd (pure kernel helper).

A kernel that keeps only its inputs for backward (``swiglu.py``, ``rms_norm.py``) makes its gradients by
running its reference formula once more on those inputs, with autograd recording, and asking autograd for the
gradients of the inputs that need one: eager's own operators, so eager's gradients bit for bit. Memory: the
formula's intermediates, for the duration of one backward call.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def replay_grads(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], needs: tuple[bool, ...],
                 grad: torch.Tensor, *args: Any) -> tuple[torch.Tensor | None, ...]:
    """``fn(*inputs, *args)``'s gradients for ``inputs`` given the output's ``grad``: None where ``needs`` is
    false."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        wanted = [t for t, need in zip(leaves, needs) if need]
        got = iter(torch.autograd.grad(fn(*leaves, *args), wanted, grad) if wanted else ())
    return tuple(next(got) if need else None for need in needs)
