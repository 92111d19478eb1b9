"""The linear head's cross-entropy kernels against their reference twin (``zeroplus/kernels/cross_entropy.py``).

Covers: the tiles' summed loss, the slices' head, bias and rows' gradients (several tiles, several slices and
blocks, the last ragged; ignored targets) against ``reference_sum`` and autograd through it, within relative
1e-5 of the largest value (fp32: the same arithmetic in another order); ``vocab_slice`` keeps a slice's
gradient within an eighth of a tile's logits and a block of logits within one tile's.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import close_to
from zeroplus.kernels.cross_entropy import SLICE_FRACTION, reference_sum, slice_backward_, tile_loss_, vocab_slice

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


@pytest.mark.parametrize("bias", [True, False])
def test_tiles_and_slices_equal_the_reference_cross_entropy(bias):
    g = torch.Generator().manual_seed(0)
    n, d, vocab, tile = 37, 4, 101, 8
    rows = torch.randn(n, d, generator=g, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, requires_grad=True)
    b = torch.randn(vocab, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::5] = -100
    reference = reference_sum(rows, weight, b, targets)
    reference.backward()

    with torch.no_grad():
        lse = torch.empty(n)
        loss = sum(tile_loss_(rows[a:a + tile], weight, b, targets[a:a + tile], -100, lse[a:a + tile])
                   for a in range(0, n, tile))
        keep = targets != -100
        scale, picked = keep.float(), torch.where(keep, targets, -1)
        step, block = vocab_slice(vocab, d, tile)
        assert 1 < step < vocab and block < n  # several slices, several blocks
        d_rows = torch.zeros(n, d)
        d_bias = torch.empty(vocab) if bias else None
        d_weight = torch.empty(vocab, d)
        for v in range(0, vocab, step):
            d_w = slice_backward_(rows, weight[v:v + step], b[v:v + step] if b is not None else None, picked - v,
                                  lse, scale, block, d_rows, d_bias[v:v + step] if d_bias is not None else None, True)
            assert d_w is not None
            d_weight[v:v + step] = d_w
    assert close_to(loss, reference.detach(), rel=1e-5)
    assert close_to(d_rows, rows.grad, rel=1e-5) and close_to(d_weight, weight.grad, rel=1e-5)
    if b is not None:
        assert d_bias is not None and close_to(d_bias, b.grad, rel=1e-5)


def test_vocab_slice_bounds_a_slice_and_a_block_by_the_tile():
    for vocab, width, tile in [(50257, 768, 512), (128256, 4096, 1024), (7, 64, 1), (101, 16, 8)]:
        s, b = vocab_slice(vocab, width, tile)
        assert 1 <= s <= vocab and (s == 1 or s * width <= tile * vocab // SLICE_FRACTION)
        assert b * s <= tile * vocab
