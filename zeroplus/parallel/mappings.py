"""Autograd-aware collectives over the tensor-parallel group: where a tensor-parallel region begins and ends.

Activations are ``(seq, batch, hidden)`` inside tensor-parallel models, so the sequence is dim 0 and a
sequence split is a contiguous slice.

| function                    | forward                             | backward                            |
|-----------------------------|-------------------------------------|-------------------------------------|
| ``copy_to_tensor``          | identity                            | all-reduce                          |
| ``reduce_from_tensor``      | all-reduce                          | identity                            |
| ``gather_last_dim``         | all-gather along the last dim       | keep this rank's slice              |
| ``scatter_to_sequence``     | keep this rank's slice of dim 0     | all-gather along dim 0              |
| ``gather_from_sequence``    | all-gather along dim 0              | reduce-scatter along dim 0          |
| ``reduce_scatter_sequence`` | reduce-scatter along dim 0          | all-gather along dim 0              |
| ``sum_grad_over_tensor``    | identity (on a parameter)           | all-reduce (the parameter's grad)   |

``sum_grad_over_tensor`` is for parameters replicated over the tensor group that see only this rank's
part of the sequence (norms under sequence parallelism): their gradients are partial sums.

Memory: each collective's output (the gathered tensor is ``T`` times its input). Communication:
the collective named, over the tensor group; none when the group has one rank.
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm import DataParallelGroup


def all_reduce(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    tp.all_reduce(x).wait()
    return x


def all_gather_dim0(x: torch.Tensor, tp: DataParallelGroup, async_op: bool = False) -> Any:
    """``(T * n, ...)`` from every rank's ``(n, ...)``, rank order; with ``async_op`` also the handle to wait on."""
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = tp.all_gather(out, x)
    if not async_op:
        handle.wait()
    return (out, handle) if async_op else out


def reduce_scatter_dim0(x: torch.Tensor, tp: DataParallelGroup, out: torch.Tensor | None = None,
                        async_op: bool = False) -> Any:
    """This rank's ``(n / T, ...)`` slice of the sum of every rank's ``(n, ...)``."""
    x = x.contiguous()
    if out is None:
        out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = tp.reduce_scatter(out, x)
    if not async_op:
        handle.wait()
    return (out, handle) if async_op else out


def _slice(x: torch.Tensor, tp: DataParallelGroup, dim: int) -> torch.Tensor:
    if x.shape[dim] % tp.size:
        raise ValueError(f"tensor-parallel rank {tp.rank}: dim {dim} of size {x.shape[dim]} does not split into "
                         f"{tp.size} equal parts")
    return x.chunk(tp.size, dim)[tp.rank].contiguous()


def _gather_last(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return all_gather_dim0(x.movedim(-1, 0), tp).movedim(0, -1).contiguous()


class _Region(torch.autograd.Function):
    """``forward(x)`` on the way in, ``backward(grad)`` on the way back: one of the pairs in the table."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: DataParallelGroup, forward: Any, backward: Any) -> torch.Tensor:
        ctx.tp, ctx.backward_fn = tp, backward
        return forward(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return ctx.backward_fn(grad, ctx.tp), None, None, None


def _identity(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return x.view_as(x)


def _summed(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return all_reduce(x.clone(), tp)


def _apply(x: torch.Tensor, tp: DataParallelGroup, forward: Any, backward: Any) -> torch.Tensor:
    return _Region.apply(x, tp, forward, backward) if tp.size > 1 else x


def copy_to_tensor(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(x, tp, _identity, lambda g, tp: all_reduce(g.contiguous(), tp))


def reduce_from_tensor(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(x, tp, _summed, _identity)


def gather_last_dim(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(x, tp, _gather_last, lambda g, tp: _slice(g, tp, -1))


def scatter_last_dim(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    """This rank's part of a last dimension every rank holds whole; the parts' gradients gathered back."""
    return _apply(x, tp, lambda x, tp: _slice(x, tp, -1), _gather_last)


def scatter_to_sequence(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(x, tp, lambda x, tp: _slice(x, tp, 0), all_gather_dim0)


def gather_from_sequence(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(x, tp, all_gather_dim0, reduce_scatter_dim0)


def reduce_scatter_sequence(x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(x, tp, reduce_scatter_dim0, all_gather_dim0)


def sum_grad_over_tensor(param: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
    return _apply(param, tp, _identity, lambda g, tp: all_reduce(g.contiguous(), tp))


__all__ = ["all_gather_dim0", "all_reduce", "copy_to_tensor", "gather_from_sequence", "gather_last_dim",
           "reduce_from_tensor", "reduce_scatter_dim0", "reduce_scatter_sequence", "scatter_last_dim",
           "scatter_to_sequence", "sum_grad_over_tensor"]
