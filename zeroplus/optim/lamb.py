"""LAMB (You et al., 2019) with DeepSpeed's FusedLamb semantics, shard-aware.

Per parameter tensor: Adam moments with bias correction, update ``u = m_hat / (sqrt(v_hat) + eps)
+ weight_decay * w``, trust ratio ``clamp(||w|| / ||u||, min_coeff, max_coeff)`` (1 when either
norm is 0), ``w -= lr * ratio * u``. The norms are per *original* parameter, so when a flat
master shard holds pieces of several parameters (ZeRO stages 1-3) the optimizer needs to know
where each piece lies: ``set_segments(flat_param, segments, dp)`` gives ``(index, start, end)``
triples and the data-parallel group; the partial squared norms of every parameter are summed
over the group with one all-reduce per flat shard, so each rank clips exactly as an unsharded
run would. Memory: two fp32 states per element (exp_avg, exp_avg_sq) and one update-sized
temporary per tensor stepped.
See note: lamb (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any, Callable, overload

import torch

from ..collectives import ScalarSum


class Lamb(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True, max_coeff: float = 10.0,
                 min_coeff: float = 0.01) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._segments: dict[int, tuple[list[tuple[int, int, int]], int, Any]] = {}

    def set_segments(self, param: torch.Tensor, segments: list[tuple[int, int, int]], num_params: int,
                     dp: ScalarSum) -> None:
        """Declare that ``param`` is a flat shard holding these pieces of ``num_params`` parameters,
        whose norms are summed over ``dp`` (every rank passes the same ``num_params``)."""
        self._segments[id(param)] = (segments, num_params, dp)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                grad = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    c1, c2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                else:
                    c1 = c2 = 1.0
                update = (m / c1) / ((v / c2).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                ratio = self._trust_ratio(p, update, group)
                p.sub_(update.mul_(ratio), alpha=group["lr"])
        return loss

    def _trust_ratio(self, p: torch.Tensor, update: torch.Tensor, group: dict) -> torch.Tensor | float:
        lo, hi = group["min_coeff"], group["max_coeff"]
        if id(p) not in self._segments:
            w, u = p.float().norm().item(), update.norm().item()
            return min(max(w / u, lo), hi) if w > 0 and u > 0 else 1.0
        segments, num_params, dp = self._segments[id(p)]
        dtype = torch.float32 if p.device.type == "npu" else torch.float64
        sums = torch.zeros(2, num_params, dtype=dtype, device=p.device)
        for i, s, e in segments:
            sums[0, i] += p[s:e].to(dtype).pow(2).sum()
            sums[1, i] += update[s:e].to(dtype).pow(2).sum()
        dp.sum_scalar(sums)
        w, u = sums[0].sqrt(), sums[1].sqrt()
        ratios = torch.where((w > 0) & (u > 0), (w / u).clamp(lo, hi), torch.ones_like(w))
        scale = torch.ones_like(update)
        for i, s, e in segments:
            scale[s:e] = float(ratios[i])
        return scale

