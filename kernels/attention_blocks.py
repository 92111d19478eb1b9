"""Attention one block of query rows over one block of keys at a time, merged by the online-softmax rule (pure
kernels; ``zeroplus/parallel/ring_attention.py`` drives them as K/V blocks travel around the ring).

``merge_block_`` computes the fp32 scores of query rows ``q`` ``(..., r, d)`` over keys ``k`` ``(..., n, d)``
(scaled; with ``causal``, a key after its query, counting the rows from ``first_row``, is masked), the block's
log-sum-exp ``l_b`` and output ``o_b = softmax(scores) @ v``, and merges them into the partial output ``o``
``(..., r, d)`` fp32 and log-sum-exp ``lse`` ``(..., r, 1)``: ``l = logaddexp(lse, l_b)``,
``o = o exp(lse - l) + o_b exp(l_b - l)``. ``block_backward_`` recomputes the block's probabilities from the
final log-sum-exp and adds its share of the gradients: ``dV += P^T dO``, ``dS = P (dO V^T - delta)`` with
``delta = rowsum(dO * O)``, ``dQ += scale dS K``, ``dK += scale dS^T Q``; ``dK`` and ``dV`` may be strided
views (of a ``(b, L, h, d)`` buffer), added into with one batched GEMM per sequence (``add_product_``), no
temporary of their size. Memory: one block of fp32 scores, ``4 r n`` bytes per batch and head (two in
backward: the probabilities and their gradient), and the fp32 casts of the block's inputs.

Reference twin: ``reference_attention``, the whole softmax attention at once (``4 R N`` bytes of scores), whose
output and log-sum-exp the merged blocks equal, and whose autograd gradients the backward blocks sum to,
within fp32 rounding (``tests/kernels/test_attention_blocks.py``: relative 1e-5).
"""
from __future__ import annotations

from typing import Any

import torch


def future_mask(rows: int, keys: int, first_row: int, device: Any) -> torch.Tensor:
    """The causal mask of rows ``first_row ..`` of a diagonal block pair: True where a key comes after its query."""
    return torch.ones(rows, keys, dtype=torch.bool, device=device).triu(first_row + 1)


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, first_row: int) -> torch.Tensor:
    """One block's scaled scores in fp32, the causal future at ``-inf``."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    if causal:
        s = s.masked_fill_(future_mask(s.shape[-2], s.shape[-1], first_row, s.device), float("-inf"))
    return s


def merge_block_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 scale: float, causal: bool, first_row: int) -> None:
    """Merge the attention of ``q`` over the block ``k``, ``v`` into ``o`` and ``lse`` (online softmax); its
    temporaries (one block of scores) are gone when it returns."""
    s = scores(q, k, scale, causal, first_row)
    l_b = torch.logsumexp(s, dim=-1, keepdim=True)
    o_b = torch.matmul(s.sub_(l_b).exp_(), v.float())
    merged = torch.logaddexp(lse, l_b)
    o.mul_(torch.exp(lse - merged)).add_(o_b.mul_(torch.exp(l_b - merged)))
    lse.copy_(merged)


def add_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += alpha * a @ b`` for ``(batch, heads, ., .)`` operands, into ``out`` (a strided view of a
    ``(b, L, h, d)`` buffer) without a temporary of its size: one batched GEMM per sequence."""
    for i in range(out.shape[0]):
        out[i].baddbmm_(a[i], b[i], alpha=alpha)


def block_backward_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
                    causal: bool, first_row: int) -> None:
    """Add the block ``k``, ``v``'s share of the gradients for query rows ``q`` into ``dq`` and of ``q``'s into
    ``dk``, ``dv`` (all fp32), the probabilities recomputed from the final ``lse``; ``do`` the output's fp32
    gradient, ``delta`` its ``rowsum(dO * O)``. Its temporaries (two blocks of scores) are gone when it returns."""
    qf, kf, vf = q.float(), k.float(), v.float()
    p = scores(qf, kf, scale, False, 0).sub_(lse).exp_()
    if causal:
        p = p.masked_fill_(future_mask(p.shape[-2], p.shape[-1], first_row, p.device), 0.0)
    add_product_(dv, p.transpose(-1, -2), do, 1.0)
    ds = p.mul_(torch.matmul(do, vf.transpose(-1, -2)).sub_(delta))
    dq.add_(torch.matmul(ds, kf), alpha=scale)
    add_product_(dk, ds.transpose(-1, -2), qf, scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: ``(softmax(q k^T scale) v, its log-sum-exp (..., R, 1))`` over all keys at once, in fp32 (with
    ``causal``, query ``i`` sees keys ``0 .. i``)."""
    s = scores(q, k, scale, causal, 0)
    return torch.matmul(torch.softmax(s, dim=-1), v.float()), torch.logsumexp(s, dim=-1, keepdim=True)
