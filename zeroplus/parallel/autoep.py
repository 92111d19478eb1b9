"""AutoEP: a Hugging Face mixture of experts split over the expert group by its own expert-parallel plan.

``"expert_parallel": {"enabled": true, "autoep_size": E}`` (DeepSpeed's keys; or ``zeroplus.parallel.expert``) on
a model whose plan (Transformers' ``model.ep_plan``: Mixtral's, Qwen3-MoE's) names its experts modules
``ep_dispatch_experts``: each such module keeps experts ``[e * N/E, (e+1) * N/E)`` of its ``N`` (every parameter
whose first dimension is the expert count, cut along it: ``gate_up_proj``, ``down_proj``, their biases) and its
``num_experts`` becomes ``N/E``. The router stays whole on every rank and routes this rank's tokens as the model
does; then, around the experts module's own forward (hooks, so the model's expert math runs unchanged):

- before it, each (token, choice) pair is sorted by expert, the counts per expert are exchanged (one all-to-all),
  and each row goes to its expert's owner (one ``all_to_all_v``); the module then runs on the rows it received,
  each routed to its local expert with weight 1 (an exact product), top-1;
- after it, the rows go back (the reverse ``all_to_all_v``) and each token's output is the sum of its choices',
  weighted by the router's weights, added in expert order as the model adds them.

Dropless by default: every pair reaches its expert. With ``zeroplus.parallel.expert_capacity_factor`` f, each
rank keeps at most ``ceil(k x tokens / N x f)`` of its pairs per expert, earlier choices and earlier tokens first
(``moe.TopKGate``'s rule); a dropped pair adds nothing to its token's output and takes no gradient. The gradients
come back the same ways (the exchanges' backward), so the router's and the hidden states' gradients are this
rank's tokens', and each expert's is every rank's tokens' for it. The expert parameters are marked
(``moe.mark_expert``): ZeRO partitions them over the expert-data group, as it does zeroplus's own ``MoE``
layers'. Refused before anything changes, naming the key, the rank and the reason: no experts module in the plan,
an expert count E does not divide, an experts module without ``num_experts`` or with a parameter that is not per
expert. Beside a tensor size, the experts are this split's and the rest AutoTP's (``plans.py``). Equal to one
process (``tests/parallel/test_autoep.py``). Memory per rank: 1/E of the experts' weights, gradients, masters and
states; the rows sent and received (``k x tokens x hidden`` each way at most). The memory estimate runs the
layout on the meta device with every expert given an equal share of the pairs (the routing is data): its
model-state categories are exact, its activations those of balanced routing.
See note: autoep (docs/design-notes.md).
"""
from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from ..comm import DataParallelGroup
from .autotp import Undo
from .dropless_moe import exchange_rows
from .moe import expert_marks, is_expert
from .plan_slices import Cut, cut_marks

DISPATCH = "ep_dispatch_experts"
_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


def ep_plan(model: nn.Module) -> dict[str, str] | None:
    plan = getattr(model, "ep_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan else None


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules the model's plan routes tokens to (``ep_dispatch_experts``), by name."""
    plan = ep_plan(model) or {}
    patterns = [re.compile(re.escape(p).replace(r"\*", r"\d+")) for p, style in plan.items() if style == DISPATCH]
    return [(name, m) for name, m in model.named_modules() if any(r.fullmatch(name) for r in patterns)]


def split_experts(model: nn.Module, ep: DataParallelGroup, where: str, done: Undo,
                  capacity_factor: float | None = None) -> None:
    """Split ``model``'s experts over ``ep`` by its plan, in place, recording what changed in ``done``; a model whose
    experts zeroplus already splits (its own ``MoE`` layers), or that has no plan, is left as it is. ``where``: the
    key and rank for an error (a ``ValueError``; the model is then as it was)."""
    if any(is_expert(p) for p in model.parameters()) or ep_plan(model) is None:
        return  # (zeroplus's own layers; or a model with no plan: initialize refuses it, naming what would split)
    found = experts_modules(model)
    _check(model, found, ep.size, where)
    for _, module in found:
        total: int = module.num_experts  # type: ignore[assignment]  # (checked)
        local = total // ep.size
        first = ep.rank * local
        for p in module.parameters(recurse=False):  # (the same Parameter objects: this rank's experts' values)
            done.cut_to(p, p.detach()[first:first + local].clone())
            done.mark(expert_marks(), p)
            done.mark(cut_marks(Cut(0), "expert"), p)
        done.replace(module, "num_experts", local)
        dispatch = _Dispatch(ep, total, capacity_factor)
        done.hooks.append(module.register_forward_pre_hook(dispatch.send, with_kwargs=True))
        done.hooks.append(module.register_forward_hook(dispatch.combine))


class _Dispatch:
    """One experts module's exchanges: ``send`` (its pre-hook) routes the rows, ``combine`` (its hook) brings the
    outputs back; what ``combine`` needs is kept between them (a stack: a recomputed forward runs both again)."""

    def __init__(self, ep: DataParallelGroup, num_experts: int, capacity_factor: float | None) -> None:
        self.ep, self.num_experts, self.capacity_factor = ep, num_experts, capacity_factor
        self.pending: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int], int]] = []

    def send(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = _routing(module, args, kwargs)
        P, N = self.ep.size, self.num_experts
        L = N // P
        pair_expert = index.reshape(-1)
        token = torch.arange(index.shape[0], device=index.device).repeat_interleave(index.shape[1])
        weight = weights.reshape(-1)
        if self.capacity_factor is not None and not index.is_meta:  # the pairs over capacity are dropped
            kept = self.kept(index).reshape(-1)
            pair_expert, token, weight = pair_expert[kept], token[kept], weight[kept]
        order = torch.argsort(pair_expert, stable=True)  # by expert, then token, then choice
        token, weight, pair_expert = token[order], weight[order], pair_expert[order]
        if index.is_meta:  # the memory estimate: no routing to read; every expert gets an equal share of the pairs
            pairs = pair_expert.numel() if self.capacity_factor is None else min(
                pair_expert.numel(), self.capacity(index.shape[0], index.shape[1]) * N)
            send = recv = [len(part) for part in torch.arange(pairs).tensor_split(P)]
            token, weight = token[:pairs], weight[:pairs]
            received = exchange_rows(hidden[token], self.ep, send, recv)
            local = torch.zeros(sum(recv), dtype=torch.long, device=index.device)
        else:
            counts = torch.bincount(pair_expert, minlength=N)
            got = torch.empty_like(counts)
            self.ep.all_to_all(got, counts).wait()  # chunk r: rank r's counts for my experts
            send = counts.view(P, L).sum(1).tolist()
            per_source = got.view(P, L)
            recv = per_source.sum(1).tolist()
            received = exchange_rows(hidden[token], self.ep, send, recv)
            local = torch.arange(L, device=index.device).repeat(P).repeat_interleave(per_source.reshape(-1))
        self.pending.append((token, weight, send, recv, hidden.shape[0]))
        ones = torch.ones(received.shape[0], 1, dtype=weights.dtype, device=weights.device)
        return (received, local.unsqueeze(1), ones), {}

    def capacity(self, tokens: int, k: int) -> int:
        assert self.capacity_factor is not None
        return max(1, math.ceil(k * tokens / self.num_experts * self.capacity_factor))

    def kept(self, index: torch.Tensor) -> torch.Tensor:
        """``(tokens, k)``: whether each pair is within its expert's capacity on this rank, earlier choices first,
        then earlier tokens (as ``moe.TopKGate`` keeps them)."""
        tokens, k = index.shape
        cap, N = self.capacity(tokens, k), self.num_experts
        kept = torch.empty_like(index, dtype=torch.bool)
        used = torch.zeros(N, dtype=torch.long, device=index.device)
        for j in range(k):
            onehot = torch.nn.functional.one_hot(index[:, j], N)
            position = (onehot.cumsum(0) - 1 + used).gather(1, index[:, j:j + 1]).squeeze(1)
            kept[:, j] = position < cap
            used += onehot.sum(0)
        return kept

    def combine(self, module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"AutoEP: {type(module).__name__} ('{DISPATCH}') returned {type(output).__name__}, "
                            f"not the one tensor of its rows' outputs")
        token, weight, send, recv, tokens = self.pending.pop()
        back = exchange_rows(output, self.ep, recv, send)
        out = back.new_zeros(tokens, back.shape[1])
        return out.index_add(0, token, back * weight.unsqueeze(1).to(back.dtype))


def _routing(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts module's ``(hidden_states, top_k_index, top_k_weights)``, given by position or by name."""
    values = dict(zip(_ARGUMENTS, args)) | {k: v for k, v in kwargs.items() if k in _ARGUMENTS}
    other = [k for k in kwargs if k not in _ARGUMENTS] + [f"argument {i}" for i in range(len(_ARGUMENTS), len(args))]
    if len(values) != len(_ARGUMENTS) or other:
        raise TypeError(f"AutoEP: {type(module).__name__} ('{DISPATCH}') was called with {sorted(values)} and "
                        f"{other}; it routes only (hidden_states, top_k_index, top_k_weights)")
    return values["hidden_states"], values["top_k_index"], values["top_k_weights"]


def check_experts(model: nn.Module, size: int, where: str) -> None:
    """Whether ``model``'s experts split over ``size`` expert ranks by its plan, without splitting them: the
    ``ValueError`` ``split_experts`` would raise (a model without a plan or without experts included), or none."""
    if ep_plan(model) is None:
        raise ValueError(f"{where}: {type(model).__name__} has no expert-parallel plan (Transformers' model.ep_plan) "
                         f"to split its experts by")
    _check(model, experts_modules(model), size, where)


def exchanged_per_token(model: nn.Module) -> int:
    """Elements each token's rows send and receive by all-to-all a training micro-batch once ``model``'s experts are
    split by its plan: per experts module, the k routed copies of its hidden row out and their outputs back, forward
    and backward (4 k H; a planner's nominal count: routing taken as balanced, every row leaving its rank)."""
    config = getattr(model, "config", None)
    k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return 4 * k * hidden * len(experts_modules(model))


def _check(model: nn.Module, found: list[tuple[str, nn.Module]], size: int, where: str) -> None:
    kind = type(model).__name__
    if not found:
        raise ValueError(f"{where}: {kind} has no experts module zeroplus splits (its expert-parallel plan, "
                         f"Transformers' model.ep_plan, names none '{DISPATCH}'); expert parallelism needs a Hugging "
                         f"Face mixture of experts with one (Mixtral, Qwen3-MoE) or zeroplus.parallel's MoE or "
                         f"DroplessMoE layers")
    problems = []
    for name, m in found:
        total = getattr(m, "num_experts", None)
        if not isinstance(total, int):
            problems.append(f"{name} ({type(m).__name__}) has no num_experts")
            continue
        if total % size:
            problems.append(f"{name} has num_experts = {total}, not divisible by {size}")
        other = [n for n, p in m.named_parameters() if "." in n or p.dim() == 0 or p.shape[0] != total]
        if other:
            problems.append(f"{name} holds parameters not per expert ({other[:4]})")
    if problems:
        raise ValueError(f"{where}: {kind}'s experts do not split over {size} expert ranks: "
                         f"{'; '.join(problems[:4])}")


__all__ = ["DISPATCH", "check_experts", "ep_plan", "exchanged_per_token", "experts_modules", "split_experts"]
