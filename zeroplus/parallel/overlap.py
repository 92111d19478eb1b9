"""Sequence-parallel matmuls with their collectives cut into chunks, so chunk i+1 communicates while chunk
i computes (``zeroplus.parallel.overlap_chunks``; 1 chunk: communicate, then compute, the same code).

Shapes: ``x`` is ``(s, b, h)`` with the sequence first; ``T`` ranks; ``s_l = s / T`` rows per rank;
a chunk is ``s_l / C`` rows of every rank's slice.

``all_gather_matmul(x_l, W, bias)``, column-parallel with the input split along the sequence:
    forward   out = gather(x_l) @ W.T + bias       (s, b, o/T): chunk i's all-gather runs while the
              matmuls of chunk i-1's gathered rows run; the gathered input is not kept.
    backward  grad_x_l = reduce_scatter(grad_out @ W): chunk i's reduce-scatter runs while chunk i+1's
              rows are multiplied; meanwhile the input is gathered again (one async all-gather) for
              grad_W = grad_out.T @ gather(x_l), computed in one product once it lands.
``matmul_reduce_scatter(x, W)``, row-parallel back to a sequence split:
    forward   out_l = reduce_scatter(x @ W.T)      (s_l, b, o): chunk i is reduce-scattered while chunk
              i+1 is multiplied.
    backward  grad_out gathered chunk by chunk, chunk i's grad_x rows multiplied while chunk i+1 arrives;
              grad_W = gather(grad_out).T @ x in one product.

The products per row and the sums per element are the same for any chunk count; only the order of
independent row blocks changes, so the chunked path equals the plain one (tested).

Memory: forward holds one chunk's gathered rows (``T * s_l / C`` rows) beside the output; backward the
gathered input (``s`` rows, freed at its end) or the gathered gradient. Communication per call: as
the plain sequence-parallel layer, in ``C`` pieces.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from ..comm import DataParallelGroup
from .mappings import all_gather_dim0


def _bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, rows))
    edges = [rows * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _gather_async(x: torch.Tensor, tp: DataParallelGroup) -> tuple[torch.Tensor, Any]:
    return all_gather_dim0(x, tp, async_op=True)


def _gathered_chunks(x: torch.Tensor, tp: DataParallelGroup, chunks: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(a, b, rows)`` per chunk of ``x``'s dim 0, ``rows`` = every rank's rows ``a..b`` (rank order);
    chunk i+1's all-gather is in flight while the caller computes with chunk i."""
    bounds = _bounds(x.shape[0], chunks)
    pending = _gather_async(x[bounds[0][0]:bounds[0][1]], tp)
    for i, (a, b) in enumerate(bounds):
        gathered, work = pending
        if i + 1 < len(bounds):
            pending = _gather_async(x[bounds[i + 1][0]:bounds[i + 1][1]], tp)
        _wait(work)
        yield a, b, gathered


def _wait(work: Any) -> None:
    if work is not None:
        work.wait()


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out = x @ weight.T (+ bias)`` written in place (``out`` contiguous, leading dims flattened)."""
    x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(x2, weight.t(), out=o2)
    else:
        torch.addmm(bias, x2, weight.t(), out=o2)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_l: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tp: DataParallelGroup, chunks: int) -> torch.Tensor:
        ctx.tp, ctx.chunks, ctx.has_bias = tp, chunks, bias is not None
        ctx.save_for_backward(x_l, weight)
        x_l = x_l.contiguous()
        s_l, T = x_l.shape[0], tp.size
        out = torch.empty((T * s_l, *x_l.shape[1:-1], weight.shape[0]), dtype=x_l.dtype, device=x_l.device)
        for a, b, gathered in _gathered_chunks(x_l, tp, chunks):
            n = b - a
            for r in range(T):  # rank r's rows a..b land at r * s_l + a
                _linear_into(out[r * s_l + a:r * s_l + b], gathered[r * n:(r + 1) * n], weight, bias)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x_l, weight = ctx.saved_tensors
        tp = ctx.tp
        grad_out = grad_out.contiguous()
        x_full, gather_work = _gather_async(x_l.contiguous(), tp)  # for grad_W, lands while grad_x computes
        grad_x = torch.empty_like(x_l)
        scatters = _reduce_scattered_products(grad_out, weight.t(), grad_x, tp, ctx.chunks)
        _wait(gather_work)
        g2 = grad_out.view(-1, grad_out.shape[-1])
        grad_w = torch.mm(g2.t(), x_full.view(-1, x_full.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        for _, work in scatters:
            _wait(work)
        return grad_x, grad_w, grad_b, None, None


def _reduce_scatter_async(out: torch.Tensor, x: torch.Tensor, tp: DataParallelGroup) -> Any:
    return tp.reduce_scatter(out, x.contiguous())


def _reduce_scattered_products(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tp: DataParallelGroup,
                               chunks: int) -> list[tuple[torch.Tensor, Any]]:
    """``out = reduce_scatter(x @ weight.T)`` along dim 0, chunk by chunk: chunk i (rows ``a..b`` of every
    rank's slice) is reduce-scattered while chunk i+1 is multiplied. Returns ``(rows, work)`` to wait on."""
    T, s_l = tp.size, out.shape[0]
    scatters = []
    for a, b in _bounds(s_l, chunks):
        n = b - a
        rows = torch.empty((T * n, *out.shape[1:]), dtype=x.dtype, device=x.device)
        for r in range(T):
            _linear_into(rows[r * n:(r + 1) * n], x[r * s_l + a:r * s_l + b], weight, None)
        scatters.append((rows, _reduce_scatter_async(out[a:b], rows, tp)))
    return scatters


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, tp: DataParallelGroup, chunks: int) -> torch.Tensor:
        ctx.tp, ctx.chunks = tp, chunks
        ctx.save_for_backward(x, weight)
        x = x.contiguous()
        T = tp.size
        if x.shape[0] % T:
            raise ValueError(f"tensor-parallel rank {tp.rank}: sequence length {x.shape[0]} does not split into "
                             f"{T} equal parts (sequence parallelism)")
        s_l = x.shape[0] // T
        out = torch.empty((s_l, *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        for _, work in _reduce_scattered_products(x, weight, out, tp, chunks):
            _wait(work)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        tp, T = ctx.tp, ctx.tp.size
        grad_out = grad_out.contiguous()
        s_l = grad_out.shape[0]
        grad_x = torch.empty_like(x)
        grad_full = torch.empty((T * s_l, *grad_out.shape[1:]), dtype=grad_out.dtype, device=grad_out.device)
        for a, b, gathered in _gathered_chunks(grad_out, tp, ctx.chunks):
            n = b - a
            for r in range(T):
                piece = gathered[r * n:(r + 1) * n]
                grad_full[r * s_l + a:r * s_l + b].copy_(piece)
                _linear_into(grad_x[r * s_l + a:r * s_l + b], piece, weight.t(), None)
        g2 = grad_full.view(-1, grad_full.shape[-1])
        grad_w = torch.mm(g2.t(), x.contiguous().view(-1, x.shape[-1]))
        return grad_x, grad_w, None, None


def all_gather_matmul(x_l: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: DataParallelGroup,
                      chunks: int = 1) -> torch.Tensor:
    return _AllGatherMatmul.apply(x_l, weight, bias, tp, chunks)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, tp: DataParallelGroup,
                          chunks: int = 1) -> torch.Tensor:
    return _MatmulReduceScatter.apply(x, weight, tp, chunks)


__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
