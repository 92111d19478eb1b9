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

Values: per row ``loss = max + log(sum(exp(logits - max))) - logits[target]``, the arithmetic of
``F.cross_entropy`` in another order, and the rows' gradient summed over vocabulary slices instead of
in one product: equal within fp32 rounding (tests: relative 1e-5 for the loss and both gradients).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .grad_rows import rows_sink

# A slice of the head's gradient is at most this fraction of one tile's logits (``4 s d <= 4 t V / 8``).
SLICE_FRACTION = 8


def vocab_slice(vocab: int, width: int, tile: int) -> tuple[int, int]:
    """``(s, b)``: vocabulary rows per slice of the head's gradient (``s * width <= tile * vocab /
    SLICE_FRACTION``, at least one row) and rows per block of logits (``b * s <= tile * vocab``)."""
    s = max(1, min(vocab, tile * vocab // (SLICE_FRACTION * width)))
    return s, max(1, tile * vocab // s)


def _log_sum_exp_(logits: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp ``(t,)`` of fp32 ``logits`` ``(t, V)``, overwriting them."""
    top = logits.amax(-1, keepdim=True)
    total = logits.sub_(top).exp_().sum(-1, keepdim=True)
    return (top + total.log()).squeeze(-1)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, tile: int, ignore_index: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        lse = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
        for a in range(0, rows.shape[0], tile):
            keep = targets[a:a + tile] != ignore_index
            logits = nn.functional.linear(rows[a:a + tile], weight, bias).float()
            picked = logits.gather(1, torch.where(keep, targets[a:a + tile], 0).unsqueeze(1)).squeeze(1)
            lse[a:a + tile] = _log_sum_exp_(logits)
            total.add_(((lse[a:a + tile] - picked) * keep).sum())
            del logits  # before the next tile's: one tile's logits at a time
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
            d_w = _slice_backward(rows, w, bias[v:v + step] if bias is not None else None, picked - v, lse, scale,
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


def _slice_backward(rows: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                    lse: torch.Tensor, scale: torch.Tensor, block: int, d_rows: torch.Tensor | None,
                    d_bias: torch.Tensor | None, want_weight: bool) -> torch.Tensor | None:
    """One vocabulary slice ``w`` ``(s, d)`` over blocks of ``block`` rows: adds the rows' share into
    ``d_rows`` and writes ``d_bias``; returns the slice's fp32 head gradient (if ``want_weight``).
    ``target``: each row's target minus the slice's first row (outside ``[0, s)``: not in this slice)."""
    s = w.shape[0]
    d_w: torch.Tensor | None = None
    for a in range(0, rows.shape[0], block):
        x = rows[a:a + block]
        g = nn.functional.linear(x, w, b).float()
        g.sub_(lse[a:a + block].unsqueeze(1)).exp_()  # softmax probabilities of this slice
        t = target[a:a + block]
        inside = (t >= 0) & (t < s)
        g.scatter_add_(1, t.clamp(0, s - 1).unsqueeze(1), -inside.unsqueeze(1).float())
        g.mul_(scale[a:a + block].unsqueeze(1))
        g_low = g if w.dtype == torch.float32 else g.to(w.dtype)
        if d_rows is not None:
            if w.dtype == torch.float32:
                d_rows[a:a + block].addmm_(g_low, w)
            else:
                d_rows[a:a + block].add_(torch.matmul(g_low, w))
        if want_weight:
            x_w = x.to(w.dtype)
            if d_w is None:
                d_w = torch.matmul(g_low.t(), x_w).float()
            elif w.dtype == torch.float32:
                d_w.addmm_(g_low.t(), x_w)  # into the accumulator: no second slice-sized buffer
            else:
                d_w.add_(torch.matmul(g_low.t(), x_w))
        if d_bias is not None:
            if a == 0:
                torch.sum(g, 0, out=d_bias)
            else:
                d_bias.add_(g.sum(0))
        del g, g_low  # before the next block's
    return d_w


def linear_cross_entropy_sum(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             targets: torch.Tensor, tile_tokens: int, ignore_index: int = -100) -> torch.Tensor:
    """The summed cross-entropy of ``rows @ weight.T + bias`` ``(N, d)`` against ``targets`` ``(N,)``, over tiles
    of ``tile_tokens`` rows (see the module docstring)."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive number of rows, got {tile_tokens}")
    return _LinearCrossEntropy.apply(rows, targets, weight, bias, int(tile_tokens), ignore_index)


__all__ = ["linear_cross_entropy_sum", "vocab_slice"]
