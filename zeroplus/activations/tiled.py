"""Tiled compute: a position-wise function run over tiles of tokens, forward and backward.

    y = tiled(fn, x, params, tile_tokens)           # fn maps (rows, d) -> (rows, e), row by row
    loss_sum = tiled(fn, x, params, tile_tokens, extras=(targets,), summed=True)  # fn -> a scalar per tile

``x`` is seen as ``(N, d)`` rows (every leading dimension flattened: batch x sequence). Forward runs
``fn`` on ``tile_tokens`` rows at a time without autograd and keeps only ``x`` (and ``extras``).
Backward runs each tile again with autograd and takes its gradients at once: the rows of ``dx``,
and each parameter's gradient summed over the tiles (in fp32 for 16-bit parameters, rounded once at
the end), handed to autograd once per backward, as an untiled call would, so the engine's gradient
hooks see one gradient per parameter. A parameter a holder module routes elsewhere (zeroplus's tied
weights, ``use_grads.py``) delivers its gradient there, per tile.

Memory, for ``N`` rows, an intermediate of width ``w`` per row inside ``fn`` (an MLP: ``4d`` or the
gated ``2 x intermediate``; an LM head with cross-entropy: the vocabulary ``V``, in fp32), ``t`` rows
per tile, ``c`` bytes per element: the untiled call saves ``N * w * c`` for backward (and the loss
``N * V * 4`` logits plus as much again for their gradient); tiled, nothing beyond ``x`` is saved,
and forward and backward hold one tile's intermediates, ``t * w * c`` (and ``t * V * 4 * 2``), plus the
parameter-gradient accumulators (``4 * P_fn`` bytes, or none beyond autograd's own in fp32: the first
tile's gradient becomes the accumulator) and one tile's gradient beside them. Compute: ``fn``'s
forward runs twice (as with activation checkpointing).

Values: ``fn`` is row-wise, so each row's output and input gradient come from the same arithmetic as
untiled, bitwise equal where the matmul kernel's result for a row does not depend on how many rows
it is given (on this project's CPUs it does: equal within 1e-6 relative, tested); parameter gradients and a summed
loss add the tiles' partial sums in tile order instead of one sum over all rows: equal within fp32
rounding of the sum (tests: relative 1e-5).

Not for functions that mix rows: attention, and mixture-of-experts layers (a token's expert
capacity depends on the whole batch) are left out where ``tile_mlps`` finds the MLPs itself.
See note: tiled mlp; see note: tile tokens (docs/design-notes.md).
"""
from __future__ import annotations

import types
from typing import Any, Callable, Sequence, TypeGuard

import torch
from torch import nn

from .linear_cross_entropy import linear_cross_entropy_sum
from .module_roles import position_wise_mlps


def _as_rows(x: torch.Tensor, extras: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``x`` as ``(N, d)`` rows and each extra with the same leading ``N`` (views)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows, [e.reshape(rows.shape[0], *e.shape[x.dim() - 1:]) for e in extras]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], tile: int, summed: bool, n_extras: int,
                x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        extras, params = rest[:n_extras], rest[n_extras:]
        rows, flat_extras = _as_rows(x, extras)
        n = rows.shape[0]
        out: torch.Tensor | None = None
        with torch.no_grad():
            for a in range(0, n, tile):
                y = fn(rows[a:a + tile], *(e[a:a + tile] for e in flat_extras))
                if summed:
                    out = y.clone() if out is None else out.add_(y)
                else:
                    if out is None:
                        out = y.new_empty((n, *y.shape[1:]))
                    out[a:a + y.shape[0]] = y
        assert out is not None, "tiled(): no rows"
        ctx.fn, ctx.tile, ctx.summed, ctx.n_extras = fn, tile, summed, n_extras
        ctx.save_for_backward(x, *extras)
        ctx.params = params
        return out if summed else out.reshape(*x.shape[:-1], *out.shape[1:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, *extras = ctx.saved_tensors
        params = [p for p in ctx.params if p.requires_grad]
        rows, flat_extras = _as_rows(x, extras)
        n = rows.shape[0]
        grad_rows = grad if ctx.summed else grad.reshape(n, *grad.shape[x.dim() - 1:])
        dx = torch.empty_like(rows) if ctx.needs_input_grad[4] else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for a in range(0, n, ctx.tile):
            with torch.enable_grad():
                xt = rows[a:a + ctx.tile].detach().requires_grad_(dx is not None)
                y = ctx.fn(xt, *(e[a:a + ctx.tile] for e in flat_extras))
                wrt = ([xt] if dx is not None else []) + params
                got = torch.autograd.grad(y, wrt, grad if ctx.summed else grad_rows[a:a + ctx.tile],
                                          allow_unused=True) if wrt else ()
            if dx is not None:
                dx[a:a + xt.shape[0]] = got[0]
                got = got[1:]
            for i, g in enumerate(got):
                if g is None:
                    continue
                if sums[i] is None:
                    sums[i] = g if g.dtype == torch.float32 else g.float()
                else:
                    sums[i].add_(g)  # type: ignore[union-attr]
        by_param = {id(p): (s.to(p.dtype) if s is not None else None) for p, s in zip(params, sums)}
        param_grads = [by_param.get(id(p)) for p in ctx.params]
        dx_out = dx.reshape(x.shape) if dx is not None else None
        return (None, None, None, None, dx_out, *([None] * ctx.n_extras), *param_grads)


def tiled(fn: Callable[..., torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor], tile_tokens: int,
          extras: Sequence[torch.Tensor] = (), summed: bool = False) -> torch.Tensor:
    """``fn`` over ``tile_tokens`` rows of ``x`` at a time (see the module docstring). ``params``: every
    tensor ``fn`` reads that needs a gradient (a module's parameters). ``extras``: per-row tensors without
    gradient (targets), split like ``x``. ``summed``: ``fn`` returns a scalar per tile; the sum is returned."""
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive number of rows, got {tile_tokens}")
    return _Tiled.apply(fn, int(tile_tokens), summed, len(extras), x, *extras, *params)


def _trainable(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def per_rank_tile(tile_tokens: int, context: int) -> int:
    """Tokens per tile on each of ``context`` ranks sharing a sequence, for tiles of ``tile_tokens`` of
    the whole sequence: ``ceil(tile_tokens / context)``, so a rank's tile holds ``1 / context`` of the
    whole-sequence tile's intermediates (rounded up to a token)."""
    return -(-tile_tokens // context)


def tile_module(module: nn.Module, tile_tokens: int) -> nn.Module:
    """Run ``module`` (a position-wise MLP: one input, one output of the same leading shape) over tiles of
    ``tile_tokens`` rows from now on. Its parameters, names and hooks stay as they are; returns it."""
    settings = vars(module)  # the tile size lives in the instance's dict: tiling again only changes it
    if "_zeroplus_tiled" not in settings:
        untiled = module.forward

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return tiled(untiled, x, _trainable(self), vars(self)["_zeroplus_tiled"])

        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    settings["_zeroplus_tiled"] = int(tile_tokens)
    return module


def tile_mlps(model: nn.Module, tile_tokens: int, classes: Sequence[str] | None = None) -> list[str]:
    """Tile every module of ``model`` whose class is named in ``classes`` (default: the outermost position-wise
    MLPs, found by what they compute, ``module_roles.position_wise_mlps``: a mixture of experts, whose routing
    needs every token at once, and its experts are left out); the qualified names tiled."""
    done = position_wise_mlps(model) if classes is None else [
        name for name, module in model.named_modules() if type(module).__name__ in classes]
    for name in done:
        tile_module(model.get_submodule(name), tile_tokens)
    return done


def cross_entropy_sum(head: Callable[[torch.Tensor], torch.Tensor], ignore_index: int = -100
                      ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A tile's summed cross-entropy of ``head(rows)`` (logits, taken in fp32) against its targets."""
    def fn(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(head(rows).float(), targets, ignore_index=ignore_index, reduction="sum")
    return fn


def _plain_linear(head: nn.Module) -> TypeGuard[nn.Linear]:
    return isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward


def head_function(head: nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """``(fn, params)`` for the tiles: a plain ``nn.Linear`` as ``F.linear`` on its own weight (a use of a
    tied weight outside its holders, which the engine adds like any other gradient: no replayed use per
    tile), any other head module called as it is."""
    if _plain_linear(head):
        weight, bias = head.weight, head.bias
        params = [p for p in (weight, bias) if p is not None and p.requires_grad]
        return (lambda rows: nn.functional.linear(rows, weight, bias)), params
    return head, _trainable(head)


def tiled_cross_entropy(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, tile_tokens: int,
                        ignore_index: int = -100, divisor: Any = None) -> torch.Tensor:
    """The cross-entropy of ``head(hidden)`` against ``targets`` (``hidden``'s leading shape), over tiles of
    ``tile_tokens`` rows: the ``(rows, vocab)`` logits exist one tile at a time, in forward and backward (a
    plain ``nn.Linear`` head: one buffer per tile, ``linear_cross_entropy.py``; any other: ``tiled``).
    Divided by ``divisor`` if given, else by the number of targets not ``ignore_index`` (the mean)."""
    targets = targets.to(hidden.device)
    if _plain_linear(head):
        rows, flat = _as_rows(hidden, (targets,))
        total = linear_cross_entropy_sum(rows, head.weight, head.bias, flat[0], tile_tokens, ignore_index)
    else:
        fn, params = head_function(head)
        total = tiled(cross_entropy_sum(fn, ignore_index), hidden, params, tile_tokens, extras=(targets,), summed=True)
    return total / (divisor if divisor is not None else (targets != ignore_index).sum())


__all__ = ["cross_entropy_sum", "head_function", "tile_mlps", "tile_module", "tiled", "tiled_cross_entropy"]
