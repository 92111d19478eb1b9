"""The single-process reference: the plain module, ``torch.optim.AdamW`` and global-norm clipping.

It sees the same global batch as the N ranks together: at step s, micro-step k, rank r trains on
batch ``(s * GA + k) * N + r``; the reference sums the gradients of all ``N * GA`` micro-batches,
each loss divided by ``N * GA``. Clipping uses the global norm computed in float64 (torch's rule
``min(1, clip / (norm + 1e-6))``), as the engine does, so fp32 runs can agree to rounding.
"""
from __future__ import annotations

import math
from typing import Callable

import torch


def reference_train(model: torch.nn.Module, batches: list, steps: int, world_size: int, gas: int, lr: float,
                    clip: float, weight_decay: float = 0.01, autocast: torch.dtype | None = None,
                    optimizer: str = "AdamW") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of rank 0's micro-batches (as the engine reports them) and the final parameters.

    ``optimizer``: "AdamW", or "SGD" (momentum 0.9), which unlike Adam is not invariant to the
    gradient's scale, so it catches a wrong averaging factor; "Lamb"; "Muon" (``MuonAndAdamW``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "SGD":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    elif optimizer == "Lamb":
        opt = PlainLamb(params, lr=lr, weight_decay=weight_decay)
    elif optimizer == "Muon":
        opt = MuonAndAdamW(model, lr=lr, weight_decay=weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for s in range(steps):
        for k in range(gas):
            for r in range(world_size):
                x, y = batches[(s * gas + k) * world_size + r]
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = model(x, y)
                (loss / (world_size * gas)).backward()
                if r == 0:
                    losses.append(loss.item())
        if clip > 0:
            clip_global_norm(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def clip_global_norm(params: list[torch.Tensor], clip: float) -> float:
    """Scale the gradients by ``min(1, clip / (norm + 1e-6))``; return the norm (float64 sum, as the engine)."""
    total = math.sqrt(sum(float(torch.dot(p.grad.reshape(-1).double(), p.grad.reshape(-1).double()))
                          for p in params if p.grad is not None))
    coef = min(1.0, clip / (total + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def train_steps(engine, batches: list) -> list[float]:
    """One engine step (forward, backward, step) per ``(x, y)`` of ``batches``: the losses."""
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def engine_train(engine, batches: list, steps: int, rank: int, world_size: int, gas: int,
                 on_step: Callable[[], None] | None = None, start: int = 0) -> list[float]:
    """Steps ``start .. start + steps - 1``; rank r's micro-batch k of step s is batch (s*GA + k)*N + r."""
    losses = []
    for s in range(start, start + steps):
        for k in range(gas):
            x, y = batches[(s * gas + k) * world_size + rank]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        if on_step is not None:
            on_step()
    return losses


MUON_LR, MUON_MOMENTUM = 0.02, 0.9


class MuonAndAdamW:
    """``torch.optim.Muon`` over the matrices the config's Muon takes (``muon_params``: DeepSpeed's rule, embeddings
    left out) at ``MUON_LR`` and ``MUON_MOMENTUM``, ``torch.optim.AdamW`` over the rest at ``lr``: the reference for
    ``"optimizer": {"type": "Muon", "params": {"lr": lr, "muon_lr": MUON_LR, "momentum": MUON_MOMENTUM, ...}}``."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float) -> None:
        from zeroplus.engine.optimizer_setup import muon_params
        chosen = muon_params(model)
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizers = [
            torch.optim.Muon([p for p in trained if id(p) in chosen], lr=MUON_LR, momentum=MUON_MOMENTUM,
                             weight_decay=weight_decay),
            torch.optim.AdamW([p for p in trained if id(p) not in chosen], lr=lr, weight_decay=weight_decay)]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


class PlainLamb(torch.optim.Optimizer):
    """LAMB written out the obvious way, one whole tensor at a time, in float64 norms: the reference
    for ``zeroplus.optim.lamb.Lamb`` (DeepSpeed FusedLamb semantics: bias correction, decoupled
    weight decay inside the update, trust ratio clamped to [0.01, 10], 1 if a norm is 0)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["t"], st["m"], st["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["t"] += 1
                st["m"] = b1 * st["m"] + (1 - b1) * p.grad
                st["v"] = b2 * st["v"] + (1 - b2) * p.grad * p.grad
                m_hat = st["m"] / (1 - b1 ** st["t"])
                v_hat = st["v"] / (1 - b2 ** st["t"])
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm = p.double().norm().item()
                u_norm = update.double().norm().item()
                ratio = min(max(w_norm / u_norm, 0.01), 10.0) if w_norm > 0 and u_norm > 0 else 1.0
                p -= group["lr"] * ratio * update


def close_to(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """``a`` within ``rel`` of the largest magnitude of ``b`` everywhere (a kernel's tolerance against its twin)."""
    return bool((a - b).abs().max() <= rel * b.abs().max())


def initialize_says(build: Callable[[], torch.nn.Module], configs: list[dict]) -> list[str]:
    """What ``zeroplus.initialize`` answers on this rank for each of ``configs``, a fresh ``build()`` each: its error's
    text, or "accepted" (that engine destroyed); the parallel groups reset after each (a layout's groups stay until
    then, and the next config may ask for another)."""
    import zeroplus
    from zeroplus.parallel import reset_parallel
    said = []
    for config in configs:
        try:
            zeroplus.initialize(build(), config).destroy()
            said.append("accepted")
        except (zeroplus.ConfigError, ValueError) as err:
            said.append(str(err))
        reset_parallel()
    return said
