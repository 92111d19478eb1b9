"""Ring attention: causal attention over a sequence split across C ranks, K/V blocks passed around the ring.

The sequence is cut into 2C chunks and rank c holds chunks ``c`` and ``2C - 1 - c`` (the zigzag split:
``zigzag_slice``), so under the causal mask every rank has the same amount of work at every step
(an early chunk with little to attend to is paired with a late one with much). Each rank keeps its
queries; its keys and values travel around the ring (rank c sends to c + 1, receives from c - 1) in
C - 1 steps, the next block's send and receive started before the current block is computed, so the
transfer overlaps the compute. Blocks are combined with the online-softmax rule: for the partial
output ``o_a`` with log-sum-exp ``l_a`` and a new block's ``o_b, l_b``,
``l = logaddexp(l_a, l_b)``, ``o = o_a exp(l_a - l) + o_b exp(l_b - l)``. Backward recomputes each
block's probabilities from the final log-sum-exp while K and V go around the ring again. The sum of
a block's dK and dV over the ranks that have computed on it travels with it, one key chunk (half a
block) at a time: a rank adds its share of a chunk into the earlier ranks' sum of it in place and
sends it on at once, so one chunk's sum travels (leaving, and the next block's arriving) while the
other chunk is computed; before a chunk's sum is sent the other's transfer is waited for, so only one
is in flight. After C moves every rank holds its own keys' whole gradient.

Masks between query chunk i and key chunk j (chunk indices in the whole sequence): j < i everything,
j == i causal, j > i nothing (skipped). A chunk pair is computed in blocks of query rows
(``query_rows``: about ``SCORE_BLOCK_ELEMENTS`` scores each); under the causal mask a block of rows
``a .. e`` reads keys ``0 .. e`` only. With a sliding window ``w`` (a query sees the keys fewer than ``w``
positions before it, Transformers' rule) a key chunk whose last key is ``w`` or more positions before the query
chunk's first query is skipped, and a block of rows reads only the keys from ``w - 1`` before its first row; a
row that sees no key of a block adds nothing to its partial output (``kernels/attention_blocks.py``).

Memory per rank, for ``b`` sequences, ``h`` heads of ``d``, ``L = s / C`` local tokens: the output
(accumulated in fp32 in the ``(b, L, h, d)`` layout, returned in the inputs' dtype) and its log-sum-exp
in fp32, kept for backward with the inputs; the output kept is the one returned, so the output
projection's saved input (the transpose back, a view) is the same storage, not a second copy; the
K/V block arriving (``2 b h L d`` elements) beside the one computed on, which is this rank's own
without a copy at the first step when its memory is already ``(b, L, h, d)`` (K and V viewed per
head from a projection's output; the blocks travel in that layout), and one block of scores, at most
``SCORE_BLOCK_ELEMENTS`` fp32 whatever ``L`` (at least 16 rows: ``16 b h L / 2``). Backward, in
units of ``b h L d`` fp32 beside its inputs: dQ (1), the K/V block computed on and the one arriving
(2 + 2; at the first step the own block, without a copy as above; nothing arrives at the last), the
dK/dV sums of three key chunks (3: the one computed into, the other leaving and the next block's
arriving) and two blocks of scores (the probabilities and their gradient); at the end the returned
dK and dV (2) replace the blocks. At ``b h L d = 1 M`` (C = 4 at 32768 tokens on 4 heads of 32,
counting new storages with a dispatch mode) 34 MiB (40 with 4 MiB blocks of scores), against 56 MiB when
a rank's whole share of a block's dK/dV was computed beside the sum arriving and the one leaving, and
each step's temporaries were still referenced when the next transfer was posted (at C = 2, 16384
tokens: 56.5 against 84.5 MiB, with 4 MiB blocks). Each step's temporaries live in
``_merge_block`` and ``_chunk_backward`` (the block kernels, ``zeroplus/kernels/attention_blocks.py``, with
their reference twin), and a block's share is added into the sum with a batched GEMM, without a product of
its size.
Communication: K and V (``2 b h L d`` elements) C - 1 times forward, and C - 1 times in
backward with dK and dV C times.
See note: ring blocks; see note: ring windows; see note: ring row blocks; see note: ring gradient sums
(docs/design-notes.md).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..comm import DataParallelGroup
from ..kernels.attention_blocks import block_backward_, merge_block_

# fp32 scores of one block of query rows: 1 MiB. At 4 MiB the ring was no faster (CPU, C = 2, 8192 tokens per
# rank, 4 heads of 32: 4.3-4.6 s against 3.7-4.4 s forward and backward, three launches each) and backward's
# two blocks held 6 MiB more.
SCORE_BLOCK_ELEMENTS = 1 << 18


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


Pair = tuple[int, int, bool, int]  # (query half, key half, causal, query chunk's start - key chunk's start)


def _pairs(q_chunks: tuple[int, int], k_chunks: tuple[int, int], n: int, window: int | None) -> list[Pair]:
    """Every chunk pair (chunks of ``n`` tokens) with something to attend to: a key chunk before the query chunk
    (skipped whole when even its last key is ``window`` or more positions before the chunk's first query), or the
    same chunk (causal)."""
    out = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            offset = (qc - kc) * n
            if kc < qc and (window is None or offset - (n - 1) < window):
                out.append((qi, ki, False, offset))
            elif kc == qc:
                out.append((qi, ki, True, 0))
    return out


def _travelling(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(b, h, L, d)`` as a contiguous ``(b, L, h, d)`` buffer to send around the ring: no copy when its
    memory already has that layout (a model's keys and values viewed per head from ``(b, L, h * d)``)."""
    return t.transpose(1, 2).contiguous()


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.shape[-2] // 2
    return t[..., :n, :], t[..., n:, :]


def _row_blocks(n: int, rows: int, offset: int, window: int | None) -> list[tuple[int, int, int, int]]:
    """``(first row, end row, first key, end key)`` of each block of query rows of an ``n x n`` chunk pair whose
    query chunk starts ``offset`` positions after its key chunk: rows ``a .. e`` see keys up to their own position
    (``offset + e``) and, under a sliding ``window``, none ``window`` or more before their first
    (``offset + a - window``), so keys outside that range are not computed at all, nor blocks with none left."""
    out = []
    for a in range(0, n, rows):
        e = min(a + rows, n)
        lo, hi = (0 if window is None else max(0, offset + a - window + 1)), min(n, offset + e)
        if lo < hi:
            out.append((a, e, lo, hi))
    return out


def _merge_block(qh: tuple[torch.Tensor, ...], kv: list[torch.Tensor], oh: tuple[torch.Tensor, ...],
                 lh: tuple[torch.Tensor, ...], pairs: list[Pair], rows: int, scale: float,
                 window: int | None) -> None:
    """Merge one K/V block's attention into the partial outputs ``oh`` and log-sum-exps ``lh`` (online
    softmax), one block of query rows at a time (``kernels/attention_blocks.py``)."""
    kh, vh = _halves(kv[0].transpose(1, 2)), _halves(kv[1].transpose(1, 2))
    for qi, ki, causal, offset in pairs:
        for a, e, lo, hi in _row_blocks(qh[qi].shape[-2], rows, offset, window):
            merge_block_(qh[qi][..., a:e, :], kh[ki][..., lo:hi, :], vh[ki][..., lo:hi, :], oh[qi][..., a:e, :],
                         lh[qi][..., a:e, :], scale, causal, offset + a - lo, window)


def _chunk_backward(qh: tuple[torch.Tensor, ...], doh: tuple[torch.Tensor, ...], lh: tuple[torch.Tensor, ...],
                    dh: tuple[torch.Tensor, ...], dqh: tuple[torch.Tensor, ...], kv: list[torch.Tensor], ki: int,
                    pairs: list[Pair], acc: list[torch.Tensor], rows: int, scale: float, window: int | None) -> None:
    """Add key chunk ``ki`` of one K/V block's share of dQ into ``dqh`` and of its dK, dV into ``acc``
    (``(b, L / 2, h, d)`` fp32), recomputing the probabilities from the final log-sum-exp, one block of query
    rows at a time (``kernels/attention_blocks.py``)."""
    kb_all, vb_all = _halves(kv[0].transpose(1, 2))[ki], _halves(kv[1].transpose(1, 2))[ki]
    dk, dv = acc[0].transpose(1, 2), acc[1].transpose(1, 2)  # (b, h, L / 2, d) views
    for qi, _, causal, offset in pairs:
        for a, e, lo, hi in _row_blocks(qh[qi].shape[-2], rows, offset, window):
            block_backward_(qh[qi][..., a:e, :], kb_all[..., lo:hi, :], vb_all[..., lo:hi, :], doh[qi][..., a:e, :],
                            lh[qi][..., a:e, :], dh[qi][..., a:e, :], dqh[qi][..., a:e, :], dk[..., lo:hi, :],
                            dv[..., lo:hi, :], scale, causal, offset + a - lo, window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DataParallelGroup,
                scale: float, rows: int, window: int | None) -> torch.Tensor:
        size, rank = group.size, group.rank
        qh = _halves(q)
        b, h, n, d = q.shape  # o in the (b, L, h, d) layout: the caller's transpose back is then a view of it
        o = torch.zeros((b, n, h, d), dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        oh, lh = _halves(o), _halves(lse.unsqueeze(-1))
        kv = [_travelling(k), _travelling(v)]  # (b, L, h, d) buffers; computed on as (b, h, L, d) views
        incoming: list[torch.Tensor] = []
        moving = None
        for step in range(size):
            if step < size - 1:
                incoming, moving = group.shift_ring(kv)  # the next block travels while this one is computed
            pairs = _pairs(_chunks(rank, size), _chunks((rank - step) % size, size), n // 2, window)
            _merge_block(qh, kv, oh, lh, pairs, rows, scale, window)
            if moving is not None:  # (none after the last step)
                moving.wait()
                kv, moving = incoming, None  # the block computed on is freed here (the handle held the one sent)
        out = o.to(q.dtype)  # (o itself in fp32)
        ctx.save_for_backward(q, k, v, out, lse)  # the output as returned: the storage the next layer saves
        ctx.group, ctx.scale, ctx.rows, ctx.window = group, scale, rows, window
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        group, scale, rows, window = ctx.group, ctx.scale, ctx.rows, ctx.window
        size, rank = group.size, group.rank
        do = grad.float()
        delta = (do * o).sum(-1, keepdim=True)  # rowsum(dO * O)
        qh, doh, lh, dh = _halves(q), _halves(do), _halves(lse.unsqueeze(-1)), _halves(delta)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dqh = _halves(dq)
        kv = [_travelling(k), _travelling(v)]  # (b, L, h, d) buffers; computed on as (b, h, L, d) views
        b, n, h, d = kv[0].shape
        kv_in: list[torch.Tensor] = []
        kv_moving = None
        # per key chunk (half of a block): the (dK, dV) sum of the ranks before this one, arriving, and its handle
        sums: list[list[torch.Tensor]] = [[], []]
        moving: list[Any] = [None, None]
        for step in range(size):
            pairs = _pairs(_chunks(rank, size), _chunks((rank - step) % size, size), n // 2, window)
            for ki in (0, 1):
                if moving[ki] is None:  # the first rank to see this block
                    acc = [torch.zeros((b, n // 2, h, d), dtype=torch.float32, device=k.device) for _ in range(2)]
                else:  # the sum of the ranks before, sent when they finished this key chunk (already waited for)
                    moving[ki].wait()
                    acc = sums[ki]
                if ki == 0 and step < size - 1:  # K and V are only read here: they travel during the compute
                    kv_in, kv_moving = group.shift_ring(kv)
                _chunk_backward(qh, doh, lh, dh, dqh, kv, ki, [pair for pair in pairs if pair[1] == ki], acc, rows,
                                scale, window)
                if moving[1 - ki] is not None:  # one chunk's transfer at a time: the other's sum is home first
                    moving[1 - ki].wait()
                # on to the rank that computes this block next (after C moves, home); the next block's sum comes in
                sums[ki], moving[ki] = group.shift_ring(acc)
                del acc  # the handle holds the sum sent until its transfer is done
            if kv_moving is not None:  # (none after the last step)
                kv_moving.wait()
                kv, kv_moving = kv_in, None
        kv = kv_in = []  # the last block computed on: gone before dK and dV are put together
        for handle in moving:
            handle.wait()
        dk, dv = (torch.cat([sums[0][i], sums[1][i]], dim=1).transpose(1, 2) for i in range(2))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def query_rows(batch_heads: int, keys: int) -> int:
    """Query rows per block so that one block's scores hold about ``SCORE_BLOCK_ELEMENTS`` (at least 16)."""
    return max(16, SCORE_BLOCK_ELEMENTS // max(1, batch_heads * keys))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DataParallelGroup | _Alone,
                   scale: float | None = None, block_rows: int | None = None,
                   window: int | None = None) -> torch.Tensor:
    """Causal attention of this rank's zigzag queries ``(b, h, L, d)`` over the whole sequence, whose keys
    and values ``(b, h, L, d)`` are spread over ``group`` in the same zigzag split (``L`` even).
    ``block_rows``: query rows per score block (default ``query_rows``: about ``SCORE_BLOCK_ELEMENTS``).
    ``window``: a sliding window (Transformers' ``sliding_window``): a query sees only the keys fewer than
    ``window`` positions before it; key chunks wholly outside it are skipped, partly outside masked."""
    if window is not None and window < 1:
        raise ValueError(f"ring attention: sliding window {window} must be a positive number of positions")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.shape[-2] % 2:
        raise ValueError(f"ring attention: {q.shape[-2]} local tokens are not two equal zigzag chunks")
    rows = query_rows(q.shape[0] * q.shape[1], q.shape[-2] // 2) if block_rows is None else int(block_rows)
    if rows < 1:
        raise ValueError(f"ring attention: block_rows must be a positive number of query rows, got {block_rows}")
    return _RingAttention.apply(q, k, v, group, scale, rows, window)


class _Done:
    def wait(self) -> None:
        pass


class _Alone:
    """A group of one rank: ``ring_attention`` over it is blocked causal attention of a whole sequence on one rank
    (what ``windowed_attention`` runs); what it passes around its ring of one comes straight back."""
    size, rank = 1, 0

    def shift_ring(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], _Done]:
        return list(tensors), _Done()


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                       window: int) -> torch.Tensor:
    """Causal attention with a sliding ``window`` of a whole sequence ``(b, h, s, d)`` held on this rank (Ulysses'
    heads), by the ring's blocks: memory one block of scores, not an ``s x s`` mask; ``s`` must be even."""
    return ring_attention(q, k, v, _Alone(), scale, window=window)


__all__ = ["SCORE_BLOCK_ELEMENTS", "query_rows", "ring_attention", "windowed_attention", "zigzag_positions",
           "zigzag_slice"]
