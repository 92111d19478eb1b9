"""Rotary position embedding on queries and keys, as Llama-family models apply it (pure kernel).

``rotary_reference`` is Hugging Face's ``apply_rotary_pos_emb``: ``x cos + rotate_half(x) sin`` for the
queries and the keys, ``cos`` and ``sin`` broadcast over the heads (``unsqueeze_dim``). Eager autograd keeps
only ``cos`` and ``sin`` (they need no gradient), so there is no memory to win on the CPU, and the
element-wise passes measured fastest as they are (``bench/bench_fused_ops.py``): the CPU and CUDA without a
fused library run the reference. ``rotary_npu`` is the Ascend fused operator (``torch_npu.npu_rotary_mul``,
one pass per tensor, its own backward); never run here. Memory: the two outputs; the reference's
temporaries (``rotate_half``'s halves, the products) are freed within the call.
"""
from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rotary_npu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover (an Ascend NPU)
    import torch_npu
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)
