"""The summed cross-entropy of a linear head over tiles of rows, its softmax gradient made in place.

    loss_sum = linear_cross_entropy_sum(rows, weight, bias, targets, tile_tokens, ignore_index)

Per tile of ``t`` rows: the logits ``rows @ weight.T + bias`` in fp32, then in that same buffer
``exp(logits - max)``, the probabilities, and in backward the logits' gradient
``(probabilities - onehot(target)) * dloss`` (zero on rows whose target is ``ignore_index``); from it the
rows' gradient ``g @ weight`` and the head's ``g.T @ rows`` (summed over tiles in fp32, rounded once at
the end for a 16-bit head) and ``g.sum(0)``. Forward keeps only the rows and targets; backward
computes the logits again (the head's forward runs twice, as with activation checkpointing).

Memory, for ``t`` rows per tile and a vocabulary ``V``: one tile's fp32 logits, ``4 t V`` bytes, forward
and backward (a 16-bit head adds its ``2 t V`` logits before the cast and the gradient's copy in its
dtype), plus the head's gradient accumulator (``4 V d``; a 16-bit head adds one tile's ``2 V d``
beside it). The generic ``tiled`` over ``F.cross_entropy`` holds about 3.5 times ``4 t V`` (the
logits, their log-softmax, the gradient; measured in ``tests/memory/test_tiled.py``); untiled,
``4 N V`` for the logits and as much for their gradient.

Values: per row ``loss = max + log(sum(exp(logits - max))) - logits[target]``, the arithmetic of
``F.cross_entropy`` in another order: equal within fp32 rounding (tests: relative 1e-5 for the loss
and the head's gradient, 1e-6 for the rows' gradient).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _probabilities_(logits: torch.Tensor) -> torch.Tensor:
    """Turn fp32 ``logits`` ``(t, V)`` into their softmax in place; their log-sum-exp ``(t,)``."""
    top = logits.amax(-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(-1, keepdim=True)
    logits.div_(total)
    return (top + total.log()).squeeze(-1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, tile: int, ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        for a in range(0, rows.shape[0], tile):
            keep = targets[a:a + tile] != ignore_index
            logits = nn.functional.linear(rows[a:a + tile], weight, bias).float()
            picked = logits.gather(1, torch.where(keep, targets[a:a + tile], 0).unsqueeze(1)).squeeze(1)
            lse = _probabilities_(logits)
            total.add_(((lse - picked) * keep).sum())
            del logits  # before the next tile's: one tile's logits at a time
        ctx.save_for_backward(rows, targets)
        ctx.weight, ctx.bias, ctx.tile, ctx.ignore_index = weight, bias, tile, ignore_index  # read again in backward
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, targets = ctx.saved_tensors
        weight, bias, tile = ctx.weight, ctx.bias, ctx.tile
        want_rows, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        want_bias = bias is not None and ctx.needs_input_grad[3]
        d_rows = torch.empty_like(rows) if want_rows else None
        d_weight: torch.Tensor | None = None
        d_bias: torch.Tensor | None = None
        for a in range(0, rows.shape[0], tile):
            x, keep = rows[a:a + tile], targets[a:a + tile] != ctx.ignore_index
            g = nn.functional.linear(x, weight, bias).float()
            _probabilities_(g)
            g.scatter_add_(1, torch.where(keep, targets[a:a + tile], 0).unsqueeze(1), -keep.unsqueeze(1).float())
            g.mul_(keep.unsqueeze(1) * grad)
            g_low = g if weight.dtype == torch.float32 else g.to(weight.dtype)
            if d_rows is not None:
                d_rows[a:a + tile] = torch.matmul(g_low, weight)
            if want_weight:
                x_w = x.to(weight.dtype)
                if d_weight is None:
                    d_weight = torch.matmul(g_low.t(), x_w).float()
                elif weight.dtype == torch.float32:
                    d_weight.addmm_(g_low.t(), x_w)  # into the accumulator: no second V x d buffer
                else:
                    d_weight.add_(torch.matmul(g_low.t(), x_w))
            if want_bias:
                d_bias = g.sum(0) if d_bias is None else d_bias.add_(g.sum(0))
            del g, g_low  # before the next tile's
        d_weight = d_weight.to(weight.dtype) if d_weight is not None else None
        d_bias = d_bias.to(bias.dtype) if d_bias is not None else None
        return d_rows, None, d_weight, d_bias, None, None


def linear_cross_entropy_sum(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, tile_tokens: int, ignore_index: int = -100) -> torch.Tensor:
    """The summed cross-entropy of ``rows @ weight.T + bias`` ``(N, d)`` against ``targets`` ``(N,)``, over tiles
    of ``tile_tokens`` rows (see the module docstring)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive number of rows, got {tile_tokens}")
    return _LinearCrossEntropy.apply(rows, targets, weight, bias, int(tile_tokens), ignore_index)


__all__ = ["linear_cross_entropy_sum"]
