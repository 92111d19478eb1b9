"""Mixture of experts over the expert-parallel group: top-k gating with a capacity, a load-balancing loss,
and all-to-all dispatch and combine (GShard's scheme).

    moe = MoE(dim, expert=lambda: MLP(...), num_experts=8, k=2, capacity_factor=1.25)
    moe = MoE(dim, expert=GroupedFFN(4 * dim, "swiglu"), num_experts=8)   # stacked, one product per projection
    y, aux_loss = moe(x)          # x (..., dim); add aux_loss * coef to the training loss

The ``E`` ranks of an expert group hold ``num_experts / E`` experts each. Per rank and expert, at most
``capacity = ceil(k * tokens / num_experts * capacity_factor)`` (at least ``min_capacity``) of this
rank's tokens are kept, earlier choices (top-1 before top-2) and earlier tokens first; the rest pass
through as zeros (the residual around the layer carries them). Dispatch packs the kept tokens into
``(num_experts, capacity, dim)``; one all-to-all sends each rank its experts' slots from every rank,
the local experts run on them, and a second all-to-all brings the outputs back, weighted by the gate's
probabilities (renormalised over the k choices when k > 1).

Load-balancing loss (Switch/GShard): ``num_experts * sum_e f_e * p_e`` with ``f_e`` the fraction of
this rank's tokens whose first choice is ``e`` and ``p_e`` the mean gate probability of ``e``: 1 when
balanced. Memory: the dispatch buffer and its all-to-all output, ``num_experts * capacity * dim``
each, and the same for the combine. Communication: two all-to-alls of that size per layer forward,
two per backward. Expert parameters are recorded (``is_expert``); ZeRO must partition them over the
expert-data group. With a ``GroupedFFN`` the local experts are one ``GroupedExperts`` (``grouped_experts.py``:
stacked weights, one batched product per projection over every local expert's slots) instead of a
``ModuleList`` of the factory's modules. In the expert-data mode (``split``, by default from the topology) each
tensor rank routes 1/T of the tokens it shares with its tensor group (``expert_tokens.py``); capacity is then
per rank's 1/T.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import DataParallelGroup
from .expert_tokens import TokenSplit
from .grouped_experts import GroupedExperts, GroupedFFN
from .groups import parallel_groups
from .registry import ParameterSet

_EXPERT = ParameterSet()


def mark_expert(param: torch.Tensor) -> torch.Tensor:
    return _EXPERT.add(param)


def expert_marks() -> ParameterSet:
    """The set ``mark_expert`` adds to (for a split that may be undone)."""
    return _EXPERT


def is_expert(param: torch.Tensor) -> bool:
    return param in _EXPERT


class _AllToAll(torch.autograd.Function):
    """Rank r's chunk i goes to rank i (dim 0 split in equal parts); the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: DataParallelGroup) -> torch.Tensor:
        ctx.ep = ep
        return _exchange(x, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad, ctx.ep), None


def _exchange(x: torch.Tensor, ep: DataParallelGroup) -> torch.Tensor:
    x = x.contiguous()
    if ep.size == 1:
        return x
    out = torch.empty_like(x)
    ep.all_to_all(out, x).wait()
    return out


_AUX_GRAD_SCALE = [1.0]  # what the loss is multiplied by before backward (engine: loss scale / accumulation)


def set_aux_grad_scale(scale: float) -> None:
    """The factor the training loss is multiplied by before its backward, so the balancing loss's
    gradient is scaled alike (the engine sets it around every backward)."""
    _AUX_GRAD_SCALE[0] = float(scale)


class _AuxLoss(torch.autograd.Function):
    """Returns ``y``; its backward also starts ``aux``'s gradient (the loss term ``aux``, scaled as the loss)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.full(ctx.aux_shape, _AUX_GRAD_SCALE[0], dtype=ctx.aux_dtype, device=grad.device)


def with_aux_loss(y: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``y``, with ``aux`` (a scalar loss term, coefficient included) added to the training loss's gradient:
    the model's output and returned loss stay the task's, and no code outside the layer handles ``aux``."""
    return _AuxLoss.apply(y, aux)


def _kept_pairs(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token, choice)`` indices where ``kept`` (n, k) is true. On the meta device (the memory estimate)
    routing has no data: every choice counts as kept, the most the index tensors can hold."""
    if kept.device.type != "meta":
        token, choice = torch.nonzero(kept, as_tuple=True)
        return token, choice
    n, k = kept.shape
    return (torch.arange(n, device=kept.device).repeat_interleave(k), torch.arange(k, device=kept.device).repeat(n))


class TopKGate(nn.Module):
    def __init__(self, dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.25,
                 min_capacity: int = 4) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"top-k gating needs 1 <= k <= num_experts = {num_experts}, got k = {k}")
        if capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
        self.wg = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.k = num_experts, k
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.split = TokenSplit()  # the expert-data mode's token split (set by MoE): router grads, aux means

    def capacity(self, tokens: int) -> int:
        return max(self.min_capacity, math.ceil(self.k * tokens / self.num_experts * self.capacity_factor))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """For tokens ``x`` (n, d): expert ``(n, k)``, slot ``(n, k)`` (-1: dropped), weight ``(n, k)``,
        the load-balancing loss, and the capacity."""
        n, E = x.shape[0], self.num_experts
        probs = F.softmax(self.split.route(self.wg, x).float(), dim=-1)  # (n, E)
        weight, expert = probs.topk(self.k, dim=-1)  # (n, k)
        if self.k > 1:
            weight = weight / weight.sum(-1, keepdim=True)
        first = F.one_hot(expert[:, 0], E).float()
        aux = E * (self.split.mean(first.mean(0)) * self.split.mean(probs.mean(0))).sum()
        cap = self.capacity(n)
        slot = torch.empty_like(expert)
        used = torch.zeros(E, dtype=torch.long, device=x.device)
        for j in range(self.k):  # earlier choices first, then earlier tokens
            onehot = F.one_hot(expert[:, j], E)  # (n, E)
            position = (onehot.cumsum(0) - 1 + used).gather(1, expert[:, j:j + 1]).squeeze(1)
            slot[:, j] = torch.where(position < cap, position, torch.full_like(position, -1))
            used += onehot.sum(0)
        return expert, slot, weight, aux, cap


class MoE(nn.Module):
    def __init__(self, dim: int, expert: Callable[[], nn.Module] | GroupedFFN, num_experts: int, *, k: int = 1,
                 capacity_factor: float = 1.25, min_capacity: int = 4, ep: DataParallelGroup | None = None,
                 split: TokenSplit | None = None) -> None:
        super().__init__()
        self.ep = ep if ep is not None else parallel_groups().expert
        self.split = split if split is not None else TokenSplit.of_topology()
        if num_experts % self.ep.size:
            raise ValueError(f"num_experts = {num_experts} does not split over an expert-parallel group of "
                             f"{self.ep.size} ranks")
        self.num_experts, self.local = num_experts, num_experts // self.ep.size
        self.first_expert = self.ep.rank * self.local
        self.gate = TopKGate(dim, num_experts, k, capacity_factor, min_capacity)
        self.gate.split = self.split
        self.experts: nn.Module = (GroupedExperts(self.local, dim, expert) if isinstance(expert, GroupedFFN)
                                   else nn.ModuleList(expert() for _ in range(self.local)))
        for p in self.experts.parameters():
            mark_expert(p)

    @property
    def grouped(self) -> bool:
        """The local experts are one ``GroupedExperts`` (stacked weights)."""
        return isinstance(self.experts, GroupedExperts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = self.split.enter(x.reshape(-1, shape[-1]))  # (n, d); the expert-data mode: this rank's n / T
        expert, slot, weight, aux, cap = self.gate(tokens)
        E, d = self.num_experts, tokens.shape[-1]
        kept = slot >= 0  # (n, k)
        rows = _kept_pairs(kept)  # (token, choice) pairs kept
        index = expert[rows] * cap + slot[rows]  # place in the (E * cap) slots
        dispatch = tokens.new_zeros(E * cap, d).index_copy(0, index, tokens[rows[0]])
        received = _AllToAll.apply(dispatch, self.ep)  # (ep x local x cap, d): each rank's slots of my experts
        received = received.view(self.ep.size, self.local, cap, d)
        if isinstance(self.experts, GroupedExperts):  # every local expert's slots in one product per projection
            ran = self.experts(received.transpose(0, 1).reshape(self.local, -1, d))
            outputs = ran.view(self.local, self.ep.size, cap, d).transpose(0, 1)  # (ep, local, cap, d)
        else:
            assert isinstance(self.experts, nn.ModuleList)
            outputs = torch.stack([self.experts[i](received[:, i].reshape(-1, d)).view(self.ep.size, cap, d)
                                   for i in range(self.local)], dim=1)  # (ep, local, cap, d)
        returned = _AllToAll.apply(outputs.reshape(E * cap, d), self.ep)  # my tokens' slots, all experts
        picked = returned.index_select(0, index) * weight[rows].to(tokens.dtype).unsqueeze(1)
        y = tokens.new_zeros(tokens.shape).index_add(0, rows[0], picked)
        return self.split.leave(y).view(shape), aux


__all__ = ["GroupedFFN", "MoE", "TopKGate", "is_expert", "mark_expert", "set_aux_grad_scale", "with_aux_loss"]
