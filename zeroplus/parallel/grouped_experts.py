"""A layer's local experts with stacked weights, run as one batched product per projection.

``MoE(dim, GroupedFFN(ffn, activation), num_experts)`` holds its ``local`` experts as

- ``w_in``  ``(local, dim, ffn)`` (``"swiglu"``: ``(local, dim, 2 ffn)``, the gate's columns then the up
  projection's), ``b_in`` ``(local, 1, ffn)`` with ``bias``;
- ``w_out`` ``(local, ffn, dim)``, ``b_out`` ``(local, 1, dim)`` with ``bias``,

instead of ``local`` separate MLP modules. Capacity routing (``moe.py``) gives every expert the same number
of rows (``ep * capacity`` slots, padding included), so the groups are equal and one ``torch.bmm`` (or
``baddbmm`` with the bias) per projection runs every local expert: 2 kernels (3 products' worth of columns
for SwiGLU) instead of ``2 local``, each over all experts' rows. ``torch._grouped_mm``
(``kernels/grouped_gemm.py``) is for unequal groups (dropless routing), which this layer does not route.

Memory: the same parameters as ``local`` MLPs (``dim ffn (2 or 3) + biases`` per expert); autograd keeps what
the loop keeps (the input, the hidden ``(local, rows, ffn)`` or ``2 ffn`` for SwiGLU, the activation), in
one tensor per projection instead of one per expert. Exactness: the reference twin ``expert_loop`` is the
same arithmetic per expert with ``F.linear``; the batched product reduces over ``dim`` in the same order on
the CPU, tested to fp32 rounding (``tests/parallel/test_grouped_experts.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = ("gelu", "relu", "swiglu")


@dataclass(frozen=True)
class GroupedFFN:
    """What each expert is: an MLP of hidden width ``ffn``; ``"swiglu"`` is ``silu(x W_gate) * (x W_up)``."""
    ffn: int
    activation: Literal["gelu", "relu", "swiglu"] = "gelu"
    bias: bool = False

    def __post_init__(self) -> None:
        if self.ffn < 1:
            raise ValueError(f"GroupedFFN.ffn must be positive, got {self.ffn}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"GroupedFFN.activation must be one of {_ACTIVATIONS}, got {self.activation!r}")


class GroupedExperts(nn.Module):
    def __init__(self, local: int, dim: int, spec: GroupedFFN) -> None:
        super().__init__()
        self.spec, self.local, self.dim = spec, local, dim
        width = 2 * spec.ffn if spec.activation == "swiglu" else spec.ffn
        self.w_in = nn.Parameter(torch.empty(local, dim, width))
        self.w_out = nn.Parameter(torch.empty(local, spec.ffn, dim))
        self.b_in = nn.Parameter(torch.empty(local, 1, width)) if spec.bias else None
        self.b_out = nn.Parameter(torch.empty(local, 1, dim)) if spec.bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as ``nn.Linear`` initialises itself (uniform in +-1/sqrt(fan_in))."""
        for w, b, fan_in in ((self.w_in, self.b_in, self.dim), (self.w_out, self.b_out, self.spec.ffn)):
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(local, rows, dim)``: expert ``i`` on ``x[i]``; ``(local, rows, dim)``."""
        h = torch.bmm(x, self.w_in) if self.b_in is None else torch.baddbmm(self.b_in, x, self.w_in)
        h = _activate(h, self.spec)
        return torch.bmm(h, self.w_out) if self.b_out is None else torch.baddbmm(self.b_out, h, self.w_out)


def _activate(h: torch.Tensor, spec: GroupedFFN) -> torch.Tensor:
    if spec.activation == "swiglu":
        gate, up = h.split(spec.ffn, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h) if spec.activation == "gelu" else F.relu(h)


def expert_loop(experts: GroupedExperts, x: torch.Tensor) -> torch.Tensor:
    """The reference twin: expert by expert, ``F.linear`` over the same weights."""
    outs = []
    for i in range(experts.local):
        b_in = None if experts.b_in is None else experts.b_in[i, 0]
        b_out = None if experts.b_out is None else experts.b_out[i, 0]
        h = _activate(F.linear(x[i], experts.w_in[i].t(), b_in), experts.spec)
        outs.append(F.linear(h, experts.w_out[i].t(), b_out))
    return torch.stack(outs)


__all__ = ["GroupedExperts", "GroupedFFN", "expert_loop"]
