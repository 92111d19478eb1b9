"""A mixture of experts without a capacity (dropless), whose hottest experts can be lent to their tokens.

    moe = DroplessMoE(dim, expert=lambda: MLP(...), num_experts=8, k=2, hot_experts=1)
    y, aux_loss = moe(x)

Routing: every token goes to its ``k`` experts (top-k of the gate's softmax, weights renormalised over the
``k``), none is dropped. Each rank sorts its (token, choice) pairs by expert, tells every rank how many it
sends to each of that rank's experts (one all-to-all of counts), and sends the tokens with one
``all_to_all_v``; each rank runs its experts on exactly the tokens routed to them, from every rank, and a second
``all_to_all_v`` brings the outputs back, weighted by the gate. A hot expert's owner therefore runs all its
tokens (the load is as skewed as the routing; ``moe.py``'s capacity routing pads and drops instead).

Lending (``hot_experts`` h > 0): the h experts with the most tokens over the expert group this step (one
all-reduce of the per-expert counts; ties to the lower index) are not routed: their owner broadcasts their
parameters to the expert group, every rank runs them on its own tokens, and in backward the parameters'
gradients are summed back onto the owner (an all-reduce; the owner keeps the sum). The other experts route as
above. The results equal routing's to fp32 rounding (the same products over other row groupings; the
gradients summed in another order). What it trades, per hot expert and step: its tokens' all-to-alls (two in
forward, two in backward, ``tokens x dim`` each) and the owner's compute on every rank's tokens, against its
parameters (a broadcast forward, an all-reduce backward) and a copy of them on every rank during the layer.
Lent experts run through ``torch.func.functional_call`` on a local expert's module (the experts share their
architecture); a rank holding no local expert cannot lend (refused). Refused with the numbers: ``hot_experts``
not below ``num_experts``, stacked (``GroupedFFN``) experts with lending. Under ZeRO-3 the lent parameters
would be read outside their module's forward, where they are not gathered: the engine refuses that pair
(``engine/build.py``).

In the expert-data mode each tensor rank routes 1/T of its tokens (``expert_tokens.py``).

The memory estimate cannot simulate this routing (its sizes are the gate's values): ``initialize`` warns that no
estimate is made, and training runs. Memory: the sorted tokens sent and received (``k x tokens x dim`` each way at
most), the experts' activations for the tokens they ran, and with lending the lent parameters (their size, per hot
expert) until backward.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import DataParallelGroup
from .expert_tokens import TokenSplit
from .groups import parallel_groups
from .moe import mark_expert


class _AllToAllV(torch.autograd.Function):
    """Rows ``send[r]`` of ``x`` to rank r, ``recv[r]`` rows from it; backward the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: DataParallelGroup, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.ep, ctx.send, ctx.recv = ep, send, recv
        return _exchange(x, ep, send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _exchange(grad, ctx.ep, ctx.recv, ctx.send), None, None, None


def exchange_rows(x: torch.Tensor, ep: DataParallelGroup, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows ``send[r]`` of ``x`` (in rank order) to rank r, ``recv[r]`` rows from it (one ``all_to_all_v``); its
    backward sends the gradients back the same way."""
    out: torch.Tensor = _AllToAllV.apply(x, ep, send, recv)
    return out


def _exchange(x: torch.Tensor, ep: DataParallelGroup, send: list[int], recv: list[int]) -> torch.Tensor:
    x = x.contiguous()
    if ep.size == 1:
        return x
    out = x.new_empty(sum(recv), x.shape[1])
    ep.all_to_all_v(out, x, recv, send)  # (sizes along dim 0: rows)
    return out


class _Lend(torch.autograd.Function):
    """The owner's parameters on every rank of ``ep`` (a broadcast); their gradients summed onto the owner."""

    @staticmethod
    def forward(ctx: Any, ep: DataParallelGroup, owner: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.ep, ctx.owner = ep, owner
        lent = []
        for p in params:
            t = p.detach().clone() if ep.rank == owner else torch.empty_like(p)
            ep.broadcast(t, owner)
            lent.append(t)
        return tuple(lent)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        summed = []
        for g in grads:
            g = g.contiguous().clone()
            ctx.ep.all_reduce(g).wait()
            summed.append(g if ctx.ep.rank == ctx.owner else None)
        return (None, None, *summed)


class DroplessMoE(nn.Module):
    def __init__(self, dim: int, expert: Callable[[], nn.Module], num_experts: int, *, k: int = 1,
                 hot_experts: int = 0, ep: DataParallelGroup | None = None, split: TokenSplit | None = None) -> None:
        super().__init__()
        self.ep = ep if ep is not None else parallel_groups().expert
        self.split = split if split is not None else TokenSplit.of_topology()
        if num_experts % self.ep.size:
            raise ValueError(f"num_experts = {num_experts} does not split over an expert-parallel group of "
                             f"{self.ep.size} ranks")
        if not 1 <= k <= num_experts:
            raise ValueError(f"top-k gating needs 1 <= k <= num_experts = {num_experts}, got k = {k}")
        if not 0 <= hot_experts < num_experts:
            raise ValueError(f"hot_experts must be at least 0 and below num_experts = {num_experts}, got "
                             f"{hot_experts}")
        if not callable(expert):
            raise ValueError("DroplessMoE takes an expert factory (stacked GroupedFFN experts are not built here)")
        self.num_experts, self.k, self.hot_experts = num_experts, k, hot_experts
        self.local = num_experts // self.ep.size
        self.first_expert = self.ep.rank * self.local
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(expert() for _ in range(self.local))
        for p in self.experts.parameters():
            mark_expert(p)
        self.last_hot: list[int] = []  # the experts lent in the last forward

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = self.split.enter(x.reshape(-1, shape[-1]))  # the expert-data mode: this rank's 1/T
        E = self.num_experts
        probs = F.softmax(self.split.route(self.gate, tokens).float(), dim=-1)
        weight, expert = probs.topk(self.k, dim=-1)
        if self.k > 1:
            weight = weight / weight.sum(-1, keepdim=True)
        aux = E * (self.split.mean(F.one_hot(expert[:, 0], E).float().mean(0)) * self.split.mean(probs.mean(0))).sum()
        pair_expert, pair_weight = expert.reshape(-1), weight.reshape(-1).to(tokens.dtype)
        pair_token = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(self.k)
        hot = self._hot(torch.bincount(pair_expert, minlength=E)) if self.hot_experts else []
        self.last_hot = hot
        routed = torch.ones_like(pair_expert, dtype=torch.bool)
        for e in hot:
            routed &= pair_expert != e
        y = tokens.new_zeros(tokens.shape)
        y = self._routed(tokens, y, pair_token[routed], pair_expert[routed], pair_weight[routed])
        for e in hot:
            mine = pair_expert == e
            y = y.index_add(0, pair_token[mine], self._lent(e, tokens[pair_token[mine]]) * pair_weight[mine, None])
        return self.split.leave(y).view(shape), aux

    def _hot(self, counts: torch.Tensor) -> list[int]:
        """The ``hot_experts`` experts with the most (token, choice) pairs over the expert group."""
        total = counts.clone()
        self.ep.all_reduce(total).wait()
        order = sorted(range(self.num_experts), key=lambda e: (-int(total[e]), e))
        return sorted(order[:self.hot_experts])

    def _routed(self, tokens: torch.Tensor, y: torch.Tensor, token: torch.Tensor, expert: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        E, P, L = self.num_experts, self.ep.size, self.local
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=E)  # per expert, what this rank sends
        got = torch.empty_like(counts)
        if P > 1:
            self.ep.all_to_all(got, counts).wait()  # chunk r: rank r's counts for my experts
        else:
            got.copy_(counts)
        send = counts.view(P, L).sum(1).tolist()
        per_source = got.view(P, L).tolist()  # [source][local expert]
        recv = [sum(row) for row in per_source]
        received = exchange_rows(tokens[token], self.ep, send, recv)
        starts, at = [], 0
        for row in per_source:  # where each (source, expert) block starts in what arrived
            starts.append([at + sum(row[:i]) for i in range(L)])
            at += sum(row)
        pieces, places = [], []
        for i in range(L):
            index = torch.cat([torch.arange(starts[s][i], starts[s][i] + per_source[s][i]) for s in range(P)])
            index = index.to(tokens.device)
            # every local expert runs, on no rows too: the exchange's backward then runs on every rank alike (a
            # rank whose experts got no token, e.g. a lent expert's owner, would otherwise leave it out and hang
            # the others, as its output would not depend on anything that takes a gradient)
            pieces.append(self.experts[i](received[index]))
            places.append(index)
        ran = received.new_zeros(received.shape).index_copy(0, torch.cat(places), torch.cat(pieces))
        back = exchange_rows(ran, self.ep, recv, send)
        return y.index_add(0, token, back * weight.unsqueeze(1))

    def _lent(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Hot expert ``e`` on ``rows``, with its owner's parameters lent to this rank."""
        owner, i = divmod(e, self.local)
        template = self.experts[i if owner == self.ep.rank else 0]
        names = [n for n, _ in template.named_parameters()]
        lent = _Lend.apply(self.ep, owner, *[p for _, p in template.named_parameters()])
        out: torch.Tensor = torch.func.functional_call(template, dict(zip(names, lent)), (rows,))
        return out


__all__ = ["DroplessMoE", "exchange_rows"]
