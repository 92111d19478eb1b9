"""SwiGLU, ``silu(gate) * up``, as one autograd function that keeps only its two inputs (pure kernel).

Eager PyTorch keeps three tensors of the MLP's intermediate width from forward to backward: ``gate`` (for
silu's backward), ``silu(gate)`` and ``up`` (for the product's). ``swiglu`` keeps ``gate`` and ``up`` and
runs the forward again in backward, under autograd. Memory: one intermediate fewer per MLP held until
backward, ``n f`` elements for ``n`` tokens of width ``f`` (in the activations' dtype); backward's
temporaries are eager's, for one MLP at a time. Time: the forward (a silu and a product) once more.

Arithmetic: eager's own operators in forward and, made again, in backward: values and gradients bit for bit
equal to eager autograd on any device (``tests/kernels/test_fused_ops.py``).

``swiglu_npu`` is the Ascend fused operator (``torch_npu.npu_swiglu`` over ``cat([gate, up])``: a copy of
both halves in exchange for one fused forward and backward); never run here.

Reference twin: ``swiglu_reference``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .replay import replay_grads


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_reference(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return replay_grads(swiglu_reference, ctx.saved_tensors, ctx.needs_input_grad, grad)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` keeping only ``gate`` and ``up`` for backward."""
    return _SwiGLU.apply(gate, up)


def swiglu_npu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # pragma: no cover (an Ascend NPU)
    import torch_npu
    return torch_npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
