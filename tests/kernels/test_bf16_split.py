"""The bf16/fp32 split against its int64 definition, on every high half and random bit patterns.

Covers: the chunked kernels equal the reference bit for bit; merge(split(x)) == x for every
non-NaN x (zeros, subnormals, the largest finite values, infinities); NaN stays NaN in both the
bf16 half and the merged value; the high half equals torch's bf16 cast except on exact ties,
where it rounds away from zero (torch rounds to even); ``round_like_shared`` is the high half.
"""
from __future__ import annotations

import torch

from zeroplus.kernels import bf16_split


def _floats_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return (((bits & 0xFFFFFFFF) + 0x80000000) % (1 << 32) - 0x80000000).to(torch.int32).view(torch.float32)


def _every_high_half() -> torch.Tensor:
    """All 65536 high halves with the low halves that matter: 0, 1, just below/at/above a tie, max."""
    high = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    random = torch.randint(0, 1 << 32, (1 << 20,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    return _floats_from_bits(torch.cat([((high[:, None] << 16) | lows[None, :]).reshape(-1), random]))


def test_split_and_merge_match_the_definition_and_restore_every_value():
    x = _every_high_half()
    old_chunk = bf16_split.CHUNK
    bf16_split.CHUNK = 100_003  # several chunks, one ragged
    try:
        high, low = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
        bf16_split.split_into(x, high, low)
        merged = bf16_split.merge_into(high, low, torch.empty_like(x))
        rounded = bf16_split.round_like_shared(x, torch.empty_like(high))
    finally:
        bf16_split.CHUNK = old_chunk
    ref_high, ref_low = bf16_split.split_reference(x)
    assert torch.equal(high.view(torch.int16), ref_high.view(torch.int16))
    assert torch.equal(low, ref_low)
    assert torch.equal(merged.view(torch.int32), bf16_split.merge_reference(ref_high, ref_low).view(torch.int32))
    assert torch.equal(rounded.view(torch.int16), high.view(torch.int16))
    nan = torch.isnan(x)
    assert torch.equal(merged.view(torch.int32)[~nan], x.view(torch.int32)[~nan]), "fp32 bits not restored"
    assert torch.isnan(merged[nan]).all() and torch.isnan(high[nan].float()).all(), "a NaN stopped being NaN"
    assert torch.equal(torch.signbit(high[nan].float()), torch.signbit(x[nan])), "NaN lost its sign"
    assert (low[nan] == 0).all()


def test_rounding_equals_torch_cast_except_ties_away_from_zero():
    x = _every_high_half()
    x = x[~torch.isnan(x)]
    high, _ = bf16_split.split_reference(x)
    cast = x.to(torch.bfloat16)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    differ = high.view(torch.int16) != cast.view(torch.int16)
    assert not (differ & ~tie).any(), "the split rounds a non-tie differently from torch's cast"
    assert differ.any()
    away = high.float().abs() >= x.abs()
    assert away[tie].all(), "a tie was not rounded away from zero"


def test_non_finite_values():
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan"), 3.4028234663852886e38, -0.0,
                      1e-45])
    high, low = bf16_split.split_reference(x)
    assert high[0].item() == float("inf") and high[1].item() == float("-inf") and low[:2].eq(0).all()
    assert torch.isnan(high[2:4].float()).all() and low[2:4].eq(0).all()
    assert high[4].item() == float("inf"), "above bf16's largest finite value: inf, as torch's cast"
    merged = bf16_split.merge_reference(high, low)
    keep = torch.tensor([0, 1, 4, 5, 6])
    assert torch.equal(merged[keep].view(torch.int32), x[keep].view(torch.int32))
