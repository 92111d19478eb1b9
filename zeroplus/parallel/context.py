"""Context parallelism: each of C ranks holds 1/C of every sequence; attention sees it whole.

Ulysses (``context_mode: "ulysses"``): before attention an all-to-all turns this rank's sequence
slice of all H heads into the whole sequence of H/C heads, and after it the reverse:

    (b, s/C, H, hd)  --seq_to_heads-->  (b, s, H/C, hd)  --attention-->  --heads_to_seq-->  (b, s/C, H, hd)

Each is the other's backward. Everything outside attention (embeddings, norms, MLPs, the loss) is
per token and runs on the local slice. The split is contiguous: rank c holds tokens
``[c * s/C, (c + 1) * s/C)``, so positions are global ones offset by ``c * s/C`` (``positions``).
Grouped-query attention: K and V go through the same all-to-all with their own (fewer) heads. The
number of query heads must be divisible by C (refused otherwise, with the numbers); key/value heads
that are not are repeated to one per query head first (``models/context_hf.py``: K and V then cost as
much as Q to send and hold).

Memory per rank: activations of s/C tokens everywhere except inside attention, which holds the whole
sequence for H/C heads (the same bytes as s/C tokens of H heads), plus each all-to-all's output; the
attention output is kept once (``ulysses_output.py``).
Communication per attention layer and micro-batch: Q, K, V and the output, each ``b * s * H * hd / C``
elements sent and received per rank in forward (4 b s h / C with h = H * hd for plain multi-head
attention; K and V scale with their own heads under GQA); in backward their gradients and the output
once more (attention's saved copy of it is formed again from the home copy: ``ulysses_output.py``).
See note: ulysses kv heads (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm import DataParallelGroup


def _all_to_all_dim0(x: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    x = x.contiguous()  # (dim-0 chunks in memory order: empty_like of a permuted view would keep its strides)
    out = torch.empty_like(x)
    group.all_to_all(out, x).wait()
    return out


def _seq_to_heads(x: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    b, s_local, heads, hd = x.shape
    c = group.size
    chunks = x.reshape(b, s_local, c, heads // c, hd).permute(2, 0, 1, 3, 4)  # chunk j: head block j
    got = _all_to_all_dim0(chunks, group)  # got[r]: rank r's tokens of this rank's head block
    return got.permute(1, 0, 2, 3, 4).reshape(b, c * s_local, heads // c, hd)


def _heads_to_seq(x: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    b, s, heads_local, hd = x.shape
    c = group.size
    chunks = x.reshape(b, c, s // c, heads_local, hd).permute(1, 0, 2, 3, 4)  # chunk j: rank j's tokens
    got = _all_to_all_dim0(chunks, group)  # got[r]: this rank's tokens of rank r's head block
    # contiguous, so that the caller's (b, s/C, H * hd) is a view of it (with one head per rank the reshape
    # alone would be a strided view of ``got``, and the caller's flattening a second copy)
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // c, c * heads_local, hd).contiguous()


class _Exchange(torch.autograd.Function):
    """One all-to-all in forward, its inverse in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: DataParallelGroup, there: Callable[..., torch.Tensor],
                back: Callable[..., torch.Tensor]) -> torch.Tensor:
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.back(grad, ctx.group), None, None, None


def check_heads(heads: int, group: DataParallelGroup) -> None:
    """Refuse a number of attention heads the context group cannot split evenly, with the numbers."""
    if heads % group.size:
        raise ValueError(f"Ulysses context parallelism splits attention heads over the context group: {heads} "
                         f"attention heads are not divisible by context size {group.size}")


def seq_to_heads(x: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    """``(b, s/C, H, hd)`` -> ``(b, s, H/C, hd)`` over the context group (identity for one rank)."""
    return x if group.size == 1 else _Exchange.apply(x, group, _seq_to_heads, _heads_to_seq)


def seq_to_heads_plain(x: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    """``seq_to_heads`` outside autograd (the all-to-all alone; ``ulysses_output.py`` re-forms a saved output)."""
    return x if group.size == 1 else _seq_to_heads(x, group)


def heads_to_seq(x: torch.Tensor, group: DataParallelGroup) -> torch.Tensor:
    """``(b, s, H/C, hd)`` -> ``(b, s/C, H, hd)``: the inverse of ``seq_to_heads``."""
    return x if group.size == 1 else _Exchange.apply(x, group, _heads_to_seq, _seq_to_heads)


def local_slice(x: torch.Tensor, group: DataParallelGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous 1/C of ``x`` along ``dim`` (a sequence length not divisible by C is refused)."""
    if group.size == 1:
        return x
    length = x.shape[dim]
    if length % group.size:
        raise ValueError(f"context parallelism splits the sequence over {group.size} ranks: length {length} "
                         f"(dim {dim}) is not divisible by {group.size}")
    part = length // group.size
    return x.narrow(dim, group.rank * part, part)


def positions(local_length: int, group: DataParallelGroup, device: Any = None) -> torch.Tensor:
    """The global positions of this rank's tokens."""
    start = group.rank * local_length
    return torch.arange(start, start + local_length, device=device)


__all__ = ["check_heads", "heads_to_seq", "local_slice", "positions", "seq_to_heads", "seq_to_heads_plain"]
