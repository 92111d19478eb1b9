"""Virtual host memory for optimizer states on Ascend NPUs (``zeroplus.virtual_optimizer_states``).

``torch_npu.empty_with_swapped_memory`` returns a tensor whose device is the NPU but whose bytes
are host memory mapped into the device's address space: the device reads and writes it over the
bus, with no copy streams, no window and no files. Such tensors support only a few operators
(``fill_``, ``zero_``, ``mul_`` and ``torch_npu.npu_apply_adam_w``), so the AdamW step on them is
that fused kernel, called per flat group with the group's fp32 master and reduced gradient, and
the states are read and written (checkpoints) with ``fill_(1)`` and ``mul_``, which are exact.

The kernel's rule (per element, ``t`` the step after this one is counted, ``b1p = b1 ** (t - 1)``):
``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
``var = var (1 - lr wd) - lr (m / (1 - b1p b1)) / (sqrt(v / (1 - b2p b2)) + eps)``: torch's
AdamW, with the bias corrections folded the same way.

Memory: exp_avg and exp_avg_sq (8 bytes per owned element) leave device memory entirely; host
memory holds them. The master and gradient stay on the device. Only AdamW (or Adam with no
weight decay) without amsgrad is supported, since that is the one kernel these tensors accept.
On every other machine the option is refused at initialisation; ``npu_kernels`` lets the tests
drive the same step with the kernel's CPU twin, written from its documented formula
(``zeroplus/kernels/npu_adam_w.py``, tested against torch's AdamW).
See note: virtual host memory (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zeroplus.ledger import Category, Ledger

TECHNIQUE = "virtual_optimizer_states"


Kernels = tuple[Callable[..., torch.Tensor], Callable[..., Any]]
CPU_TWIN: Kernels | None = None  # set by tests only: (allocate, apply_adam_w) that run on the CPU


def npu_kernels() -> Kernels | None:
    """(allocate, apply_adam_w) from torch_npu, or None where they do not exist."""
    if CPU_TWIN is not None:
        return CPU_TWIN
    try:
        import torch_npu  # type: ignore[import-not-found]
    except ImportError:
        return None
    if not hasattr(torch_npu, "empty_with_swapped_memory") or not hasattr(torch_npu, "npu_apply_adam_w"):
        return None
    return torch_npu.empty_with_swapped_memory, torch_npu.npu_apply_adam_w


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what ``npu_apply_adam_w`` cannot compute."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(f"needs AdamW (the one kernel swapped-memory tensors accept), not {type(optimizer).__name__}")
    for g in optimizer.param_groups:
        if g.get("amsgrad") or (type(optimizer) is torch.optim.Adam and g.get("weight_decay", 0)):
            raise ValueError("needs AdamW without amsgrad (Adam's coupled weight decay is another rule)")


class VirtualStates:
    """exp_avg and exp_avg_sq of one flat group in swapped (host-backed) device memory."""

    def __init__(self, numel: int, device: torch.device, ledger: Ledger, kernels: Kernels) -> None:
        allocate, self._apply = kernels
        self.exp_avg = allocate([numel], dtype=torch.float32, device=device).zero_()
        self.exp_avg_sq = allocate([numel], dtype=torch.float32, device=device).zero_()
        self.steps = 0
        self.ledger = ledger
        self.saved = 8 * numel
        ledger.save(TECHNIQUE, Category.OPTIM_STATE, self.saved)

    def step(self, master: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """One AdamW step of ``master`` (fp32, on the device) with ``grad`` under ``group``'s options."""
        beta1, beta2 = group["betas"]
        wd = group["weight_decay"] if "weight_decay" in group else 0.0
        self._apply(beta1 ** self.steps, beta2 ** self.steps, float(group["lr"]), float(wd), beta1, beta2,
                    group["eps"], grad, None, False, bool(group.get("maximize", False)),
                    out=(master, self.exp_avg, self.exp_avg_sq))
        self.steps += 1

    def state(self) -> dict[str, Any]:
        """Ordinary device tensors with the states' values (for a checkpoint), as torch's AdamW keeps them."""
        return {"step": torch.tensor(float(self.steps)),
                "exp_avg": torch.empty_like(self.exp_avg).fill_(1).mul_(self.exp_avg),
                "exp_avg_sq": torch.empty_like(self.exp_avg_sq).fill_(1).mul_(self.exp_avg_sq)}

    def load(self, state: dict[str, Any]) -> None:
        self.steps = int(state["step"].item() if isinstance(state["step"], torch.Tensor) else state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            getattr(self, key).fill_(1).mul_(state[key].to(getattr(self, key).device))

    def close(self) -> None:
        self.ledger.unsave(TECHNIQUE, Category.OPTIM_STATE, self.saved)

