"""RMSNorm as Llama-family models compute it, keeping only its input for backward (pure kernel).

The formula (Hugging Face's ``LlamaRMSNorm`` and its copies in Qwen2, Mistral, ...): ``x`` in fp32, divided
by the root of its mean square plus ``eps``, rounded back to ``x``'s dtype, times ``weight``. Eager autograd
keeps the fp32 copy of ``x`` and the normalised ``x`` (and, in 16-bit, both in two dtypes) from forward to
backward: 8 bytes per element in fp32, 6 in bf16. ``rms_norm`` keeps ``x`` itself (4 or 2 bytes per element,
and the residual stream usually holds it anyway) and runs the same formula again in backward under autograd,
so its gradients are eager's bit for bit. Memory: ``n d`` elements of the input's dtype per norm held until
backward (eager: ``2 n d`` fp32 plus ``n d`` of the dtype in 16-bit); backward's temporaries are eager's, one
norm at a time. Time: the norm's forward once more in backward (a few element-wise passes).

``rms_norm_npu`` is the Ascend fused operator (``torch_npu.npu_rms_norm``: its own backward, which rounds
otherwise); never run here.

Reference twin: ``rms_norm_reference``.
"""
from __future__ import annotations

from typing import Any

import torch

from .replay import replay_grads


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_reference(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*replay_grads(rms_norm_reference, ctx.saved_tensors, ctx.needs_input_grad[:2], grad, ctx.eps), None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_reference``'s values and gradients, keeping only ``x`` (and ``weight``) for backward."""
    return _RMSNorm.apply(x, weight, eps)


def rms_norm_npu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # pragma: no cover (NPU)
    import torch_npu
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
