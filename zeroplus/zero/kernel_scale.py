"""The step's gradient coefficient applied inside torch's fused Adam kernel instead of a pass of its own.

Every step multiplies the gradients by one coefficient first (``sharded_step.py``: ``1 / loss_scale``, ``1 / N``
at stage 0, a binding clip's ``clip / norm``), a pass over them that reads and writes ``2 * c * n`` bytes for
``n`` elements (the plain module's ``clip_grad_norm_`` pays the same, ``_foreach_mul_``). torch's fused Adam and
AdamW take a ``grad_scale`` (``torch.amp.GradScaler`` hands them the loss scale that way) and divide each
gradient by it inside the step's own kernel, which writes it back divided: setting it to ``1 / coef`` for the
one ``step()`` call (or the several of a chunked step) leaves no separate pass. Used by every step that runs
torch's optimizer (one rank's ``direct_step.py``; the flat, chunked and tiered steps), so each stays bit for bit
the others, as the shared-master and offload tests hold them; virtual host memory's kernel is not torch's and
multiplies first (within its stated 1e-5). Memory: a 0-d fp32 tensor. Values: ``g / (1 / coef)`` instead of
``g * coef``, within an ulp or two of the gradient; where the step is bit for bit the plain module's (one rank,
no binding clip) the coefficient is 1 and nothing is set. Only where every param group of the optimizer is
fused (torch refuses ``grad_scale`` on its other kernels, even for a group with no gradient) and nobody else set
a ``grad_scale`` or ``found_inf``. See note: clip inside the fused step (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..optim.stored_states import StoredStates


def scales_in_kernel(optimizer: torch.optim.Optimizer, coef: float) -> bool:
    """Whether ``optimizer.step()`` can apply ``coef`` (not 1) inside its kernel: torch's Adam or AdamW, fused in
    every param group, with no ``grad_scale`` or ``found_inf`` of anyone else's."""
    return coef != 1.0 and takes_device_scalars(optimizer) and free_for_scalars(optimizer)


@contextlib.contextmanager
def divided_in_kernel(optimizer: torch.optim.Optimizer, coef: float, device: torch.device) -> Iterator[None]:
    """Around the ``step()`` calls that apply ``coef`` in the kernel (``scales_in_kernel`` said so): the optimizer's
    ``grad_scale`` is ``1 / coef`` on ``device``, and gone afterwards."""
    optimizer.grad_scale = torch.full((), 1.0 / coef, dtype=torch.float32, device=device)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]


def takes_device_scalars(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can take the step's coefficient and overflow flag as device tensors: torch's
    Adam or AdamW, fused in every param group (its ``grad_scale`` divides each gradient in the kernel, its
    ``found_inf`` makes the kernel leave the parameter, its states and its step count as they were), or their
    stored-states counterparts, which run that kernel (``optim/stored_states.py``)."""
    return ((type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) or isinstance(optimizer, StoredStates))
            and all(pg.get("fused") for pg in optimizer.param_groups))


def free_for_scalars(optimizer: torch.optim.Optimizer) -> bool:
    """Nobody else (a ``GradScaler``) has set the optimizer's ``grad_scale`` or ``found_inf``."""
    return getattr(optimizer, "grad_scale", None) is None and getattr(optimizer, "found_inf", None) is None


@contextlib.contextmanager
def scalars_in_kernel(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor,
                      found_inf: torch.Tensor) -> Iterator[None]:
    """Around the ``step()`` calls of a step whose scalars stay on the device (``takes_device_scalars``): the
    kernel divides every gradient by ``grad_scale`` (``1 / coef``, fp32) and, where ``found_inf`` is 1, changes
    nothing (torch's fused step then takes its step count back)."""
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
