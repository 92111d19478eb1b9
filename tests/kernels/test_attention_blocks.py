"""The online-softmax attention block kernels against their reference twin (``zeroplus/kernels/attention_blocks.py``).

Covers: query rows in blocks of 5 (the last ragged) merged over two key blocks each (under the causal mask the
keys before the rows whole and the diagonal block masked, as ring attention calls them) equal the whole softmax
attention's output and log-sum-exp; the backward blocks, summed, equal autograd's dQ, dK and dV through the
twin, dK and dV added into strided ``(b, L, h, d)`` views as the ring does. With a sliding window (4 and 7 of 17
positions) the earlier keys' block leaves some rows with nothing to see, merged first: they must stay empty, not
NaN. Relative 1e-5 of the largest value.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import close_to
from zeroplus.kernels.attention_blocks import block_backward_, merge_block_, reference_attention

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 4), (True, 7)])
def test_blocks_merged_and_their_gradients_equal_whole_attention(causal, window):
    g = torch.Generator().manual_seed(0)
    b, h, n, d, rows, scale = 2, 3, 17, 8, 5, 8 ** -0.5
    q, k, v, do = (torch.randn(b, h, n, d, generator=g) for _ in range(4))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref_o, ref_lse = reference_attention(qr, kr, vr, scale, causal, window)
    ref_o.backward(do)

    o = torch.zeros(b, h, n, d)
    lse = torch.full((b, h, n, 1), float("-inf"))
    blocks = []
    for a in range(0, n, rows):
        e = min(a + rows, n)
        if causal:  # the keys before the block whole, then the diagonal block under the mask
            blocks.append((a, e, ([(0, a, False)] if a else []) + [(a, e, True)]))
        else:  # two key blocks, merged one after the other
            blocks.append((a, e, [(0, n // 2, False), (n // 2, n, False)]))
    for a, e, keys in blocks:
        for k0, k1, diagonal in keys:
            merge_block_(q[..., a:e, :], k[..., k0:k1, :], v[..., k0:k1, :], o[..., a:e, :], lse[..., a:e, :], scale,
                         diagonal, a - k0, window)
    assert close_to(o, ref_o.detach(), rel=1e-5) and close_to(lse, ref_lse.detach(), rel=1e-5)

    delta = (do * o).sum(-1, keepdim=True)
    dq = torch.zeros(b, h, n, d)
    dk_buffer, dv_buffer = torch.zeros(b, n, h, d), torch.zeros(b, n, h, d)  # the ring's layout
    dk, dv = dk_buffer.transpose(1, 2), dv_buffer.transpose(1, 2)
    for a, e, keys in blocks:
        for k0, k1, diagonal in keys:
            block_backward_(q[..., a:e, :], k[..., k0:k1, :], v[..., k0:k1, :], do[..., a:e, :], lse[..., a:e, :],
                            delta[..., a:e, :], dq[..., a:e, :], dk[..., k0:k1, :], dv[..., k0:k1, :], scale,
                            diagonal, a - k0, window)
    assert close_to(dq, qr.grad, rel=1e-5) and close_to(dk, kr.grad, rel=1e-5) and close_to(dv, vr.grad, rel=1e-5)
