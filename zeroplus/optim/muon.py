"""Muon over flat master shards: whole matrices orthogonalized by their owner rank, AdamW for the rest.

``"optimizer": {"type": "Muon", "params": {...}}`` (DeepSpeed's name and keys). Which parameters Muon takes is
DeepSpeed's rule, so one config splits a model alike in both: a parameter with two or more dimensions whose name
holds neither ``embed`` nor ``lm_head`` (``split_groups``; each incoming param group gives a Muon half and an AdamW
half, flat groups never mixing the two). The matrices' update is ``torch.optim.Muon``'s, element for element:
``buf = lerp(buf, g, 1 - momentum)``, ``u = lerp(g, buf, momentum)`` (Nesterov; ``buf`` without), ``O =
NS(u)``: ``ns_steps`` quintic Newton-Schulz iterations in bf16 on the matrix scaled to unit Frobenius norm
(``orthogonalize``), then ``w *= 1 - lr * weight_decay`` and ``w -= lr * sqrt(max(1, rows / cols)) * O``
(``adjust_lr_fn``: torch's ``original``, or ``match_rms_adamw``: ``0.2 * sqrt(max(rows, cols))``). The rest step
with torch's AdamW (``betas``, ``eps``, ``weight_decay``), fused where the device has it. ``muon_lr`` and ``adam_lr``
set each half's rate where ``lr`` is shared.

Sharded (stages 1-3, ``set_matrices``): the momentum and ``u`` are element-wise, computed on the shard; a matrix
cut across ranks is made whole for Newton-Schulz by one all-gather of the group's ``u`` shards into a buffer of the
group's padded size (fp32, ledger ``comm_buffer``); each matrix is orthogonalized by one rank, its owner
(assigned once, largest first to the least loaded rank: the iteration costs about ``rows * cols * min(rows,
cols)``), which writes ``O`` over its ``u`` in the buffer while every other rank zeroes it there; one
reduce-scatter then hands each rank its shard of every ``O``, exact (each element has one non-zero addend).
Traffic: the group's padded size twice per step (as much as a ZeRO-3 gather and reduce). Stage 0 and one rank
orthogonalize every matrix in place. Memory: one fp32 state per element (``momentum_buffer``) where AdamW keeps two,
one shard-sized ``u`` and the buffer, one flat group at a time. Equal to one process with ``torch.optim.Muon`` and
``torch.optim.AdamW`` on the same parameters (``tests/optim/test_muon.py``).
See note: muon (docs/design-notes.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..collectives import Collectives

# torch.optim.Muon's defaults (Keller Jordan's coefficients)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_KEYS = ("lr", "momentum", "weight_decay", "nesterov", "ns_coefficients", "ns_steps", "ns_eps", "adjust_lr_fn")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
ADJUST_LR = ("original", "match_rms_adamw")


def takes_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's rule for which parameters Muon steps: matrices (two or more dimensions), not the embeddings or
    the output head (by name)."""
    lowered = name.lower()
    return param.dim() >= 2 and "embed" not in lowered and "lm_head" not in lowered


def split_groups(groups: list[dict[str, Any]], muon: set[int], params: dict[str, Any]) -> list[dict[str, Any]]:
    """Each param group as its Muon half (the parameters whose id is in ``muon``) then its AdamW half (a half with no
    parameter left out), each with the config's settings for that half (``muon_lr`` / ``adam_lr`` over ``lr``)
    under the group's own."""
    halves = []
    for group in groups:
        own = {k: v for k, v in group.items() if k != "params"}
        for use_muon, keys, rate in ((True, MUON_KEYS, "muon_lr"), (False, ADAM_KEYS, "adam_lr")):
            chosen = [p for p in group["params"] if (id(p) in muon) is use_muon]
            if not chosen:
                continue
            settings = {k: params[k] for k in keys if k in params}
            if rate in params:
                settings["lr"] = params[rate]
            settings.update({k: v for k, v in own.items() if k in keys})
            halves.append(dict(settings, params=chosen, use_muon=use_muon))
    return halves


def muon_kwargs(params: dict[str, Any], fused: bool) -> dict[str, Any]:
    """``ShardedMuon``'s arguments from the config's ``optimizer.params`` (DeepSpeed's keys and torch.optim.Muon's);
    a key it cannot honour is a ValueError naming it. ``muon_lr`` and ``adam_lr`` are read by ``split_groups``."""
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key in ("muon_lr", "adam_lr"):
            continue
        if key == "ns_method":
            raise ValueError(f"config key 'optimizer.params.ns_method' ({value!r}): zeroplus runs torch.optim.Muon's "
                             f"Newton-Schulz iteration (bf16, {NS_COEFFICIENTS}), not DeepSpeed's 'gram' or "
                             f"'standard' ones, which round differently; remove the key")
        if key == "per_head_muon" and value:
            raise ValueError("config key 'optimizer.params.per_head_muon' is true: zeroplus orthogonalizes each "
                             "matrix whole; remove the key")
        if key == "adam_w_mode":
            if value is False:
                raise ValueError("config key 'optimizer.params.adam_w_mode' is false: the parameters Muon does not "
                                 "take step with AdamW (decoupled weight decay) here")
            continue
        if key == "per_head_muon":
            continue
        if key not in _CONSTRUCTOR:
            raise ValueError(f"config key 'optimizer.params.{key}' (value {value!r}) is not a parameter of Muon here "
                             f"(it takes {', '.join(sorted(_CONSTRUCTOR + ('muon_lr', 'adam_lr')))})")
        kwargs[key] = tuple(value) if isinstance(value, list) else value
    return dict(kwargs, fused=fused)


_CONSTRUCTOR = ("lr", "momentum", "weight_decay", "nesterov", "ns_coefficients", "ns_steps", "ns_eps", "adjust_lr_fn",
                "betas", "eps")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The rate a matrix of ``shape`` steps at (``torch.optim.Muon``'s adjustment; more than two dimensions: the
    first against the rest, as DeepSpeed views a convolution's filters)."""
    rows, cols = shape[0], shape.numel() // shape[0]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def orthogonalize(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
                  ) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of ``update`` (2-D), in bf16 as ``torch.optim.Muon`` runs it: scaled to
    unit Frobenius norm, then ``X <- a X + (b X X^T + c (X X^T)^2) X`` ``steps`` times, on the wide orientation."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@dataclass
class MatrixLayout:
    """Where a flat group's matrices lie and who orthogonalizes each: shapes and offsets in the group, the pieces of
    them this rank owns (``(matrix index, start, end)`` relative to its owned range: the group's
    ``param_segments()``), the group to gather over (None: this rank holds every element, stage 0 or one rank), and
    the buffer maker (the ledger's)."""

    shapes: list[torch.Size]
    offsets: list[int]
    padded_numel: int
    segments: list[tuple[int, int, int]]
    group: Collectives | None
    buffer: Callable[[int], torch.Tensor]
    owners: list[int] = field(default_factory=list)


def _cost(shape: torch.Size) -> int:
    rows, cols = shape[0], shape.numel() // shape[0]
    return rows * cols * min(rows, cols)


def balance(layouts: list[MatrixLayout]) -> None:
    """Each matrix's owner, over every group's matrices together (a group may hold one: stage 3's units, small
    buckets): largest first (Newton-Schulz costs about ``rows * cols * min(rows, cols)``), each to the least loaded
    rank of its group's ranks (ties: the lowest). The same on every rank: every rank passes the same layouts."""
    load: dict[int, list[int]] = {}
    work = [(layout, i) for layout in layouts for i in range(len(layout.shapes))]
    for layout in layouts:
        layout.owners = [0] * len(layout.shapes)
    for layout, i in sorted(work, key=lambda w: -_cost(w[0].shapes[w[1]])):  # (stable: ties keep the layout order)
        if layout.group is None:
            continue
        ranks = load.setdefault(id(layout.group), [0] * layout.group.size)
        rank = min(range(len(ranks)), key=lambda r: (ranks[r], r))
        layout.owners[i] = rank
        ranks[rank] += _cost(layout.shapes[i])


@runtime_checkable
class MatrixOptimizer(Protocol):
    """An optimizer that needs whole matrices (Muon): told, once, where each flat shard's matrices lie."""

    def takes_matrices(self, param: torch.Tensor) -> bool: ...

    def set_matrices(self, param: torch.Tensor, layout: MatrixLayout) -> None: ...


class ShardedMuon(torch.optim.Optimizer):
    """Muon for the groups marked ``use_muon``, torch's AdamW for the others (see the module's docstring)."""

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 ns_steps: int = 5, ns_eps: float = 1e-7, adjust_lr_fn: str | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, fused: bool | None = None) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        if adjust_lr_fn not in (None, *ADJUST_LR):
            raise ValueError(f"Muon: adjust_lr_fn {adjust_lr_fn!r} is not one of {ADJUST_LR}")
        if not 0 < ns_steps < 100:
            raise ValueError(f"Muon: ns_steps must be in 1..99, got {ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=ns_eps,
                        adjust_lr_fn=adjust_lr_fn, betas=tuple(betas), eps=eps, use_muon=True)
        super().__init__(params, defaults)
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self.adam: torch.optim.AdamW | None = None
        if adam_groups:
            self.adam = torch.optim.AdamW([{"params": g["params"]} for g in adam_groups], fused=fused)
            for mine, theirs in zip(adam_groups, self.adam.param_groups):
                for key, value in theirs.items():
                    mine.setdefault(key, value)
            self.adam.param_groups = adam_groups  # one set of groups (a schedule's lr reaches both) ...
            self.adam.state = self.state  # ... and one state (checkpoints read this optimizer's)
        self._layouts: dict[int, MatrixLayout] = {}

    def takes_matrices(self, param: torch.Tensor) -> bool:
        return any(g["use_muon"] and any(p is param for p in g["params"]) for g in self.param_groups)

    def set_matrices(self, param: torch.Tensor, layout: MatrixLayout) -> None:
        """Declare that ``param`` is a flat shard of the matrices in ``layout``."""
        self._layouts[id(param)] = layout

    def owners(self) -> list[int]:
        """The ranks that orthogonalize some matrix of a sharded group (inspection: how the work was spread)."""
        return sorted({rank for layout in self._layouts.values() if layout.group is not None for rank in layout.owners})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step of every parameter with a gradient: the matrices' (whole, or this rank's shards of them), then
        AdamW's. ``closure``: recomputes the loss first, as torch's optimizers take it."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.grad is not None:
                    self._step_matrices(p, p.grad, group)
        if self.adam is not None and any(p.grad is not None for g in self.adam.param_groups for p in g["params"]):
            self.adam.step()
        return loss

    def _step_matrices(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf.clone()
        layout = self._layouts.get(id(p))
        if layout is None:  # a whole parameter (no engine around it): as torch.optim.Muon steps it
            if p.dim() < 2:
                raise ValueError(f"Muon steps whole matrices; a parameter of shape {tuple(p.shape)} came with no "
                                 f"layout of the matrices it is a flat shard of (set_matrices)")
            layout = MatrixLayout([p.shape], [0], p.numel(), [(0, 0, p.numel())], None, torch.empty)
            p_flat, update = p.view(-1), update.view(-1)
        else:
            p_flat = p
        self._orthogonalize(update, layout, group)
        p_flat.mul_(1 - group["lr"] * group["weight_decay"])
        for i, a, b in layout.segments:
            p_flat[a:b].add_(update[a:b], alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], layout.shapes[i]))

    def _orthogonalize(self, update: torch.Tensor, layout: MatrixLayout, group: dict[str, Any]) -> None:
        """``update`` (this rank's shard of the flat group) replaced by its shard of every matrix's NS."""
        settings = (group["ns_coefficients"], group["ns_steps"], group["ns_eps"])
        if layout.group is None:
            for off, shape in zip(layout.offsets, layout.shapes):
                piece = update[off:off + shape.numel()]
                piece.copy_(orthogonalize(piece.view(shape[0], -1), *settings).reshape(-1))
            return
        whole = layout.buffer(layout.padded_numel)
        layout.group.all_gather(whole, update).wait()
        rank, end = layout.group.rank, 0
        for i, (off, shape) in enumerate(zip(layout.offsets, layout.shapes)):
            piece = whole[off:off + shape.numel()]
            whole[end:off].zero_()  # (gaps: none between a group's parameters; the padding after the last)
            if layout.owners[i] == rank:
                piece.copy_(orthogonalize(piece.view(shape[0], -1), *settings).reshape(-1))
            else:
                piece.zero_()
            end = off + shape.numel()
        whole[end:].zero_()
        layout.group.reduce_scatter(update, whole).wait()
        del whole
