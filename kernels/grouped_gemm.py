"""Grouped matrix products for mixtures of experts: rows sorted by expert, one weight per expert (pure kernel).

``x`` ``(n, d)`` holds each expert's rows one after another, ``ends`` the int32 end of each expert's rows
(cumulative counts, ``E`` of them), ``w`` ``(E, d, f)``: row block ``e`` is multiplied by ``w[e]``.
``grouped_mm`` is ``torch._grouped_mm`` (one call for every expert: one kernel on a CUDA device of compute
capability 9.0 or more in bf16; a loop inside ATen elsewhere); ``grouped_mm_reference`` is the Python loop
of ``E`` matrix products and a concatenation. Memory: the ``(n, f)`` output; the reference also holds each
expert's product until the concatenation (``n f`` elements more at its peak). Both are differentiable.
Equal to the reference bit for bit on the CPU (the same products); on a GPU within its matmul's rounding.
"""
from __future__ import annotations

import torch


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    starts = [0] + ends[:-1].tolist()
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, ends.tolist()))])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch._grouped_mm(x, w, offs=ends)
    if out.requires_grad:  # its backward refuses an expanded gradient (a ``sum()``'s): made contiguous first
        out.register_hook(lambda grad: grad.contiguous())
    return out
