"""``torch_npu.npu_apply_adam_w`` stated in plain torch: the CPU twin of the one kernel that steps optimizer
states kept in an Ascend NPU's swapped (host-backed) memory (``offload/virtual_host.py``).

The NPU kernel's documented rule, per element, in place on ``(var, m, v)``, with ``b1p = b1 ** (t - 1)`` and
``b2p = b2 ** (t - 1)`` the beta powers before this step: ``m = b1 m + (1 - b1) g``,
``v = b2 v + (1 - b2) g^2``, ``var = var (1 - lr wd) - lr (m / (1 - b1p b1)) / (sqrt(v / (1 - b2p b2)) + eps)``
(``g`` negated with ``maximize``). That is torch's AdamW with its bias corrections folded in another order, so
its reference twin is ``torch.optim.AdamW`` (``tests/kernels/test_npu_adam_w.py``: relative 1e-6 over several
steps). Memory: two temporaries of the tensor's size (the corrected ``v``'s root and the update).

``allocate`` stands for ``torch_npu.empty_with_swapped_memory`` (plain ``torch.empty`` here): the tests drive the
engine's virtual-memory path on the CPU with ``(allocate, apply_adam_w)``.
"""
from __future__ import annotations

import torch


def allocate(size: list[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Stands for ``torch_npu.empty_with_swapped_memory`` (uninitialised; the caller zeroes it)."""
    return torch.empty(size, dtype=dtype, device=device)


def apply_adam_w(beta1_power: float, beta2_power: float, lr: float, weight_decay: float, beta1: float,
                 beta2: float, eps: float, grad: torch.Tensor, max_grad_norm: torch.Tensor | None, amsgrad: bool,
                 maximize: bool, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``npu_apply_adam_w``'s signature and rule (see above), in place on ``out = (var, m, v)``."""
    if max_grad_norm is not None or amsgrad:
        raise NotImplementedError("the twin states npu_apply_adam_w without max_grad_norm and amsgrad, the way "
                                  "zeroplus calls it")
    var, m, v = out
    g = -grad if maximize else grad
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v / (1 - beta2_power * beta2)).sqrt_().add_(eps)
    var.mul_(1 - lr * weight_decay).sub_(lr * (m / (1 - beta1_power * beta1)) / denom)
    return var, m, v
