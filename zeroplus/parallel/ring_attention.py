"""Ring attention: causal attention over a sequence split across C ranks, K/V blocks passed around the ring.

The sequence is cut into 2C chunks and rank c holds chunks ``c`` and ``2C - 1 - c`` (the zigzag split:
``zigzag_slice``), so under the causal mask every rank has the same amount of work at every step
(an early chunk with little to attend to is paired with a late one with much). Each rank keeps its
queries; its keys and values travel around the ring (rank c sends to c + 1, receives from c - 1) in
C - 1 steps, the next block's send and receive started before the current block is computed, so the
transfer overlaps the compute (in backward the keys and values overlap it, their gradients follow).
Blocks are combined with the online-softmax rule: for the partial output ``o_a`` with log-sum-exp
``l_a`` and a new block's ``o_b, l_b``,
``l = logaddexp(l_a, l_b)``, ``o = o_a exp(l_a - l) + o_b exp(l_b - l)``. Backward recomputes each
block's probabilities from the final log-sum-exp, sends the key/value blocks around again together
with their gradient accumulators, which arrive back at their owner after the last step.

Masks between query chunk i and key chunk j (chunk indices in the whole sequence): j < i everything,
j == i causal, j > i nothing (skipped).

Memory per rank, for ``b`` sequences, ``h`` heads of ``d``, ``L = s / C`` local tokens: the output
and its log-sum-exp (kept for backward, with the inputs), two K/V blocks (the one computed on and the
one arriving: ``2 * 2 * b h L d`` elements), and one block's scores, ``b h (L/2)^2`` per chunk pair;
backward adds the travelling dK/dV (``2 * b h L d``, twice while one is in flight). Communication: K
and V (``2 b h L d`` elements) C - 1 times forward; K, V, dK and dV C times backward.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..comm import DataParallelGroup


def zigzag_slice(x: torch.Tensor, group: DataParallelGroup, dim: int = 1) -> torch.Tensor:
    """Chunks ``c`` and ``2C - 1 - c`` of ``x``'s ``2C`` chunks along ``dim``, concatenated."""
    c, size = group.rank, group.size
    if size == 1:
        return x
    length = x.shape[dim]
    if length % (2 * size):
        raise ValueError(f"ring attention splits the sequence into 2 x {size} chunks: length {length} (dim {dim}) "
                         f"is not divisible by {2 * size}")
    chunk = length // (2 * size)
    return torch.cat([x.narrow(dim, c * chunk, chunk), x.narrow(dim, (2 * size - 1 - c) * chunk, chunk)], dim=dim)


def zigzag_positions(local_length: int, group: DataParallelGroup, device: Any = None) -> torch.Tensor:
    """The global positions of this rank's zigzag tokens."""
    whole = torch.arange(local_length * group.size, device=device)
    return zigzag_slice(whole.unsqueeze(0), group).squeeze(0)


def _chunks(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def _future(n: int, device: Any) -> torch.Tensor:
    """The causal mask of a diagonal chunk pair: True where a key comes after its query."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk pair: the normalised output and the log-sum-exp of its scores (fp32)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(_future(n, s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def _pairs(q_chunks: tuple[int, int], k_chunks: tuple[int, int]) -> list[tuple[int, int, bool]]:
    """(query half, key half, causal) for every chunk pair with something to attend to."""
    out = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            if kc < qc:
                out.append((qi, ki, False))
            elif kc == qc:
                out.append((qi, ki, True))
    return out


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[-2] // 2
    return t[..., :n, :], t[..., n:, :]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DataParallelGroup,
                scale: float) -> torch.Tensor:
        size, rank = group.size, group.rank
        qh = _halves(q)
        out = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in qh]
        lse = [torch.full(h.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device) for h in qh]
        kv = [k.contiguous(), v.contiguous()]
        incoming: list[torch.Tensor] = []
        moving = None
        for step in range(size):
            if step < size - 1:
                incoming, moving = group.shift_ring(kv)  # the next block travels while this one is computed
            source = (rank - step) % size
            kh, vh = _halves(kv[0]), _halves(kv[1])
            for qi, ki, causal in _pairs(_chunks(rank, size), _chunks(source, size)):
                o_b, l_b = _block(qh[qi], kh[ki], vh[ki], scale, causal)
                merged = torch.logaddexp(lse[qi], l_b)
                out[qi] = (out[qi] * torch.exp(lse[qi] - merged).unsqueeze(-1)
                           + o_b * torch.exp(l_b - merged).unsqueeze(-1))
                lse[qi] = merged
            if moving is not None and step < size - 1:
                moving.wait()
                kv = incoming
        o = torch.cat(out, dim=-2)
        l_all = torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, o, l_all)
        ctx.group, ctx.scale = group, scale
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        size, rank = group.size, group.rank
        do = grad.float()
        delta = (do * o).sum(-1)  # rowsum(dO * O)
        qh, doh, lh, dh = _halves(q), _halves(do), _halves(lse.unsqueeze(-1)), _halves(delta.unsqueeze(-1))
        dq = [torch.zeros(h.shape, dtype=torch.float32, device=q.device) for h in qh]
        travelling = [k.contiguous(), v.contiguous(), torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                      torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
        for step in range(size):
            source = (rank - step) % size
            kb, vb, dk, dv = travelling
            kv_in, kv_moving = group.shift_ring([kb, vb])  # K and V are only read here: they travel during the compute
            kh, vh = _halves(kb), _halves(vb)
            dkh, dvh = list(_halves(dk)), list(_halves(dv))
            for qi, ki, causal in _pairs(_chunks(rank, size), _chunks(source, size)):
                s = torch.matmul(qh[qi].float(), kh[ki].float().transpose(-1, -2)) * scale
                p = torch.exp(s - lh[qi])
                if causal:
                    n = p.shape[-1]
                    p = p.masked_fill(_future(n, p.device), 0.0)
                dvh[ki].add_(torch.matmul(p.transpose(-1, -2), doh[qi]))
                dp = torch.matmul(doh[qi], vh[ki].float().transpose(-1, -2))
                ds = p * (dp - dh[qi])
                dq[qi].add_(torch.matmul(ds, kh[ki].float()) * scale)
                dkh[ki].add_(torch.matmul(ds.transpose(-1, -2), qh[qi].float()) * scale)
            # the gradients follow their block; after C moves both are home (dK, dV of this rank's own keys)
            d_in, d_moving = group.shift_ring([dk, dv])
            kv_moving.wait()
            d_moving.wait()
            travelling = kv_in + d_in
        return (torch.cat(dq, dim=-2).to(q.dtype), travelling[2].to(k.dtype), travelling[3].to(v.dtype), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DataParallelGroup,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries ``(b, h, L, d)`` over the whole sequence, whose keys
    and values ``(b, h, L, d)`` are spread over ``group`` in the same zigzag split (``L`` even)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention: {q.shape[-2]} local tokens are not two equal zigzag chunks")
    return _RingAttention.apply(q, k, v, group, scale)


__all__ = ["ring_attention", "zigzag_positions", "zigzag_slice"]
