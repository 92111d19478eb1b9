"""The expert-data mode's token split: each tensor rank routes 1/T of the tokens its tensor group shares.

In the expert-data mode (``zeroplus.parallel.experts_span_tensor``; ``topology.py``) the expert group is drawn
from data x tensor ranks, so the T ranks of a tensor group are different expert ranks. They hold the same
tokens (the residual stream is replicated between tensor-parallel regions), and if each routed all of them
every token would reach its experts T times. So a mixture-of-experts layer (``moe.py``, ``dropless_moe.py``)
keeps this rank's contiguous 1/T of the flattened tokens on the way in (backward: the input's gradient
all-gathered, as every rank's upstream needs it whole) and all-gathers the outputs on the way out (backward:
this rank's slice of the gradient, which is whole and equal on every tensor rank). Under sequence parallelism
the tokens arrive split already and leave split: nothing is cut or gathered.

Either way the router sees only this rank's tokens, so its weight's gradient is a partial sum, all-reduced over
the tensor group in backward (``sum_grad_over_tensor``), and the balancing loss's per-expert means are averaged
over the tensor group (forward all-reduce, backward identity), so the loss, and its gradient, are those of the
tensor group's whole token set. The result equals every token routed once in one process (with a capacity: the
capacity is computed from this rank's 1/T of the tokens).

Memory: the gathered output, the layer's tokens x dim (as the replicated input). Communication per layer: one
all-gather of the output (forward) and one of the input's gradient (backward), tokens x dim each, one all-reduce
of the router's gradient and two of ``num_experts`` means; none outside the expert-data mode.
See note: expert-data mode (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any

import torch

from ..comm import DataParallelGroup
from .groups import parallel_groups
from .mappings import all_gather_dim0, reduce_from_tensor, scatter_to_sequence, sum_grad_over_tensor


class _GatherTokens(torch.autograd.Function):
    """Every tensor rank's rows, in rank order; backward this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: DataParallelGroup) -> torch.Tensor:
        ctx.tp, ctx.rows = tp, x.shape[0]
        out: torch.Tensor = all_gather_dim0(x, tp)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        start = ctx.tp.rank * ctx.rows
        return grad[start:start + ctx.rows], None


class TokenSplit:
    """How a mixture-of-experts layer shares its tokens with the other ranks of its tensor group.

    ``tensor``: that group (``None`` or one rank: nothing is split, every method is the identity).
    ``presplit``: the tokens arrive as this rank's part already (sequence parallelism)."""

    def __init__(self, tensor: DataParallelGroup | None = None, presplit: bool = False) -> None:
        self.tensor = tensor if tensor is not None and tensor.size > 1 else None
        self.presplit = presplit

    @classmethod
    def of_topology(cls, presplit: bool = False) -> TokenSplit:
        """The split the current process groups ask for: the tensor group in the expert-data mode, else none."""
        groups = parallel_groups()
        return cls(groups.tensor if groups.topology.experts_span_tensor else None, presplit)

    @property
    def active(self) -> bool:
        return self.tensor is not None

    def enter(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``tokens`` (n, d): a contiguous 1/T (``n`` divisible by T, else refused)."""
        if self.tensor is None or self.presplit:
            return tokens
        if tokens.shape[0] % self.tensor.size:
            raise ValueError(f"expert-data mode on tensor rank {self.tensor.rank}: the layer's {tokens.shape[0]} "
                             f"tokens do not split into {self.tensor.size} equal parts (tensor size); use a batch "
                             f"x sequence divisible by it")
        out: torch.Tensor = scatter_to_sequence(tokens, self.tensor)
        return out

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output for every token of the tensor group (gathered), or this rank's part (presplit)."""
        if self.tensor is None or self.presplit:
            return y
        out: torch.Tensor = _GatherTokens.apply(y, self.tensor)
        return out

    def route(self, router: torch.nn.Linear, tokens: torch.Tensor) -> torch.Tensor:
        """``router(tokens)``; split, with its weight's gradient summed over the tensor ranks' token parts (the
        module's own forward is called when nothing is split, so hooks and wrappers on it see the call)."""
        if self.tensor is None:
            out: torch.Tensor = router(tokens)
            return out
        bias = None if router.bias is None else sum_grad_over_tensor(router.bias, self.tensor)
        return torch.nn.functional.linear(tokens, sum_grad_over_tensor(router.weight, self.tensor), bias)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """A mean over this rank's tokens made the mean over the tensor group's (equal parts)."""
        if self.tensor is None:
            return value
        return reduce_from_tensor(value, self.tensor) / self.tensor.size


__all__ = ["TokenSplit"]
