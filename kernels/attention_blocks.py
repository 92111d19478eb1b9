"""Attention one block of query rows over one block of keys at a time, merged by the online-softmax rule (pure
kernels; ``zeroplus/parallel/ring_attention.py`` drives them as K/V blocks travel around the ring).

``merge_block_`` computes the fp32 scores of query rows ``q`` ``(..., r, d)`` over keys ``k`` ``(..., n, d)``
(scaled; with ``causal``, a key after its query, counting the rows from ``first_row``, is masked, and with a
sliding ``window`` a key ``window`` or more positions before it: ``band_mask``), the block's
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


def band_mask(rows: int, keys: int, first_row: int, causal: bool, window: int | None,
              device: Any) -> torch.Tensor | None:
    """True where query row ``r`` may not see key ``c`` of a block whose first query sits ``first_row`` positions after
    its first key: with ``causal`` a key after its query (``c > first_row + r``), with a sliding ``window`` a key
    ``window`` or more positions before it (``first_row + r - c >= window``, Transformers' rule). None when no
    element of the block is masked."""
    future = causal and keys - 1 > first_row
    far = window is not None and first_row + rows - 1 >= window
    if not (future or far):
        return None
    distance = (torch.arange(rows, device=device) + first_row).unsqueeze(-1) - torch.arange(keys, device=device)
    mask = distance < 0 if future else torch.zeros(rows, keys, dtype=torch.bool, device=device)
    return mask | (distance >= window) if window is not None and far else mask


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, first_row: int,
           window: int | None = None) -> torch.Tensor:
    """One block's scaled scores in fp32, what ``band_mask`` masks at ``-inf``."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
    mask = band_mask(s.shape[-2], s.shape[-1], first_row, causal, window, s.device)
    return s if mask is None else s.masked_fill_(mask, float("-inf"))


def merge_block_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                 scale: float, causal: bool, first_row: int, window: int | None = None) -> None:
    """Merge the attention of ``q`` over the block ``k``, ``v`` into ``o`` and ``lse`` (online softmax); its
    temporaries (one block of scores) are gone when it returns. With a ``window`` a row may see no key of the
    block (its log-sum-exp ``-inf``): it then adds nothing, and a row that has seen nothing yet stays empty."""
    s = scores(q, k, scale, causal, first_row, window)
    l_b = torch.logsumexp(s, dim=-1, keepdim=True)
    merged = torch.logaddexp(lse, l_b)
    # without a window every row sees a key (the diagonal, or a whole earlier block); with one, an empty row's -inf
    # is shifted by 0 instead, so its probabilities and weights are 0, not NaN
    shift, base = (l_b, merged) if window is None else (_finite(l_b), _finite(merged))
    o_b = torch.matmul(s.sub_(shift).exp_(), v.float())
    o.mul_(torch.exp(lse - base)).add_(o_b.mul_(torch.exp(l_b - base)))
    lse.copy_(merged)


def _finite(t: torch.Tensor) -> torch.Tensor:
    return t.masked_fill(t == float("-inf"), 0.0)


def add_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += alpha * a @ b`` for ``(batch, heads, ., .)`` operands, into ``out`` (a strided view of a
    ``(b, L, h, d)`` buffer) without a temporary of its size: one batched GEMM per sequence."""
    for i in range(out.shape[0]):
        out[i].baddbmm_(a[i], b[i], alpha=alpha)


def block_backward_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
                    causal: bool, first_row: int, window: int | None = None) -> None:
    """Add the block ``k``, ``v``'s share of the gradients for query rows ``q`` into ``dq`` and of ``q``'s into
    ``dk``, ``dv`` (all fp32), the probabilities recomputed from the final ``lse``; ``do`` the output's fp32
    gradient, ``delta`` its ``rowsum(dO * O)``. Its temporaries (two blocks of scores) are gone when it returns."""
    qf, kf, vf = q.float(), k.float(), v.float()
    p = scores(qf, kf, scale, False, 0).sub_(lse).exp_()
    mask = band_mask(p.shape[-2], p.shape[-1], first_row, causal, window, p.device)
    if mask is not None:
        p = p.masked_fill_(mask, 0.0)
    add_product_(dv, p.transpose(-1, -2), do, 1.0)
    ds = p.mul_(torch.matmul(do, vf.transpose(-1, -2)).sub_(delta))
    dq.add_(torch.matmul(ds, kf), alpha=scale)
    add_product_(dk, ds.transpose(-1, -2), qf, scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: ``(softmax(q k^T scale) v, its log-sum-exp (..., R, 1))`` over all keys at once, in fp32 (with
    ``causal``, query ``i`` sees keys ``0 .. i``; with a ``window``, only those after ``i - window``)."""
    s = scores(q, k, scale, causal, 0, window)
    return torch.matmul(torch.softmax(s, dim=-1), v.float()), torch.logsumexp(s, dim=-1, keepdim=True)
