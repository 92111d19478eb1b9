"""The summed cross-entropy of a linear head over tiles of rows, its gradient made by vocabulary slices.

    loss_sum = linear_cross_entropy_sum(rows, weight, bias, targets, tile_tokens, ignore_index)

Forward, per tile of ``t`` rows: the logits ``rows @ weight.T + bias`` in fp32, then in that same buffer
their log-sum-exp per row; kept for backward: the rows, the targets and the ``(N,)`` log-sum-exps.
Backward makes the head's gradient one vocabulary slice of ``s`` rows at a time (``vocab_slice``): for
each slice, over blocks of ``b`` rows, the logits of that slice again, in place their gradient
``(exp(logits - lse) - onehot(target)) * dloss`` (zero on rows whose target is ``ignore_index``), from
which the slice's head gradient ``g.T @ rows`` (summed over blocks in fp32, rounded once for a 16-bit
head), its bias gradient ``g.sum(0)``, and the rows' share ``g @ weight[slice]`` (summed over slices in
fp32). Each finished slice of the head's gradient goes to the engine's sink for the weight when there
is one (``grad_rows.py``: straight into its flat gradient buffer), else into a whole gradient returned
as usual. The head's forward runs twice (as with activation checkpointing).

Memory, for ``N`` rows, ``t`` rows per tile, a vocabulary ``V`` and width ``d``: forward, one tile's fp32
logits, ``4 t V`` bytes; backward, one block of logits of the same size at most (``b * s <= t * V``),
one slice's head gradient, ``4 s d`` (at most an eighth of a tile's logits), the rows' gradient in
fp32, ``4 N d``, and the log-sum-exps, ``4 N``; a 16-bit head adds its ``2 b s`` logits before the
cast and copies of the slice in its dtype. The head's whole gradient, ``4 V d`` (16-bit: ``2 V d``),
exists only without a sink. The generic ``tiled`` over ``F.cross_entropy`` holds about 3.5 times
``4 t V`` (the logits, their log-softmax, the gradient; measured in ``tests/memory/test_tiled.py``);
untiled, ``4 N V`` for the logits and as much for their gradient.

The per-tile and per-slice arithmetic are pure kernels with a reference twin
(``zeroplus/kernels/cross_entropy.py``); this module drives them and routes each slice's gradient.

Values: per row ``loss = max + log(sum(exp(logits - max))) - logits[target]``, the arithmetic of
``F.cross_entropy`` in another order, and the rows' gradient summed over vocabulary slices instead of
in one product: equal within fp32 rounding (tests: relative 1e-5 for the loss and both gradients).
See note: tiled loss; see note: vocabulary slices (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any

import torch

from ..kernels.cross_entropy import SLICE_FRACTION, slice_backward_, tile_loss_, vocab_slice
from .grad_rows import rows_sink


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, tile: int, ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        for a in range(0, rows.shape[0], tile):  # one tile's logits at a time
            total.add_(tile_loss_(rows[a:a + tile], weight, bias, targets[a:a + tile], ignore_index, lse[a:a + tile]))
        ctx.save_for_backward(rows, targets, lse)
        ctx.weight, ctx.bias, ctx.tile, ctx.ignore_index = weight, bias, tile, ignore_index  # read again in backward
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, targets, lse = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        want_rows, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        want_bias = bias is not None and ctx.needs_input_grad[3]
        vocab = weight.shape[0]
        keep = targets != ctx.ignore_index
        scale = keep * grad  # (N,) fp32: dloss on counted rows, 0 on ignored ones
        picked = torch.where(keep, targets, -1)
        sink = rows_sink(weight) if want_weight else None
        whole = torch.empty_like(weight) if want_weight and sink is None else None
        d_rows = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device) if want_rows else None
        d_bias = torch.empty(vocab, dtype=torch.float32, device=rows.device) if want_bias else None
        step, block = vocab_slice(vocab, weight.shape[1], ctx.tile)
        for v in range(0, vocab, step):
            w = weight[v:v + step]
            d_w = slice_backward_(rows, w, bias[v:v + step] if bias is not None else None, picked - v, lse, scale,
                                  block, d_rows, d_bias[v:v + step] if d_bias is not None else None, want_weight)
            if d_w is None:
                continue
            d_w = d_w.to(weight.dtype)  # rounded once for a 16-bit head
            if sink is not None:
                sink(v, d_w, v + step >= vocab)
            elif whole is not None:
                whole[v:v + step] = d_w
            del d_w  # before the next slice's
        return (d_rows.to(rows.dtype) if d_rows is not None else None, None, whole,
                d_bias.to(bias.dtype) if d_bias is not None else None, None, None)


def linear_cross_entropy_sum(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, tile_tokens: int, ignore_index: int = -100) -> torch.Tensor:
    """The summed cross-entropy of ``rows @ weight.T + bias`` ``(N, d)`` against ``targets`` ``(N,)``, over tiles
    of ``tile_tokens`` rows (see the module docstring)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive number of rows, got {tile_tokens}")
    return _LinearCrossEntropy.apply(rows, targets, weight, bias, int(tile_tokens), ignore_index)


__all__ = ["SLICE_FRACTION", "linear_cross_entropy_sum", "vocab_slice"]
