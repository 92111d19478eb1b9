"""BF16/FP32 shared storage: an fp32 value held as a bf16 high half plus a 16-bit residual.

Split: view the fp32 bits as an integer ``x``; ``high = (x + 0x8000) >> 16`` is the bf16 the
model computes with (the magnitude rounded to nearest, ties away from zero, since the sign is
separate), ``low = x - (high << 16)`` is a signed 16-bit residual in ``[-0x8000, 0x7fff]``.
Merge: ``x = (high << 16) + low`` restores the fp32 bits exactly. Memory: 2 + 2 bytes per
element instead of 4 (fp32 master) + 2 (separate bf16 copy).

Rounding. Ties (low half exactly 0x8000) round away from zero, where torch's ``.to(bfloat16)``
rounds them to even; everything else equals torch's cast, including overflow of values above
bf16's largest finite value to infinity (the residual still restores them exactly).

Non-finite values. +-inf split into a bf16 +-inf and a zero residual and merge back exactly.
NaN splits into a quiet bf16 NaN of the same sign (its top 16 bits with the quiet bit set) and
a zero residual, so the model computes with a NaN and the merged master is a NaN; the payload
bits of the low half are not kept. (Without this rule some NaNs would round to inf or wrap to
-0.0.)

``split_reference`` / ``merge_reference`` spell the math out in int64 and allocate freely; they
are the definition the tests hold ``split_into`` / ``merge_into`` to. The latter write into
given buffers chunk by chunk: one int32 scratch of at most ``CHUNK`` elements (4 MiB), reusable
across calls, plus NaN masks only for chunks that may hold a NaN.
See note: split arithmetic; see note: split nan (docs/design-notes.md).
"""
from __future__ import annotations

import torch

CHUNK = 1 << 20
_QUIET = 0x0040  # bf16 mantissa's top bit


def _as_int16_pattern(value: torch.Tensor) -> torch.Tensor:
    """int64 holding 0..0xffff -> int16 with those bits."""
    return (((value + 0x8000) & 0xFFFF) - 0x8000).to(torch.int16)


def split_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 high halves, int16 residuals); the definition."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = ((bits + 0x8000) >> 16) & 0xFFFF
    low = bits - (high << 16)
    nan = torch.isnan(x)
    high = torch.where(nan, (bits >> 16) | _QUIET, high)
    low = torch.where(nan, torch.zeros_like(low), low)
    return _as_int16_pattern(high).view(torch.bfloat16), low.to(torch.int16)


def merge_reference(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """(bf16 high halves, int16 residuals) -> fp32; the definition."""
    hi = high.view(torch.int16).to(torch.int64) & 0xFFFF
    bits = ((hi << 16) + low.to(torch.int64)) & 0xFFFFFFFF
    return (((bits + 0x80000000) & 0xFFFFFFFF) - 0x80000000).to(torch.int32).view(torch.float32)


# The residual's bits are exactly the low 16 bits of the fp32 (``x - (high << 16)`` taken mod
# 2^16), so the split is two conversions of the int32 view: ``low = int16(x)`` (truncation) and
# ``high = int16((x + 0x8000) >> 16)``; int32 arithmetic wraps only for NaN bit patterns, which
# the fix-up replaces. The merge is ``float(high)`` (bf16 to fp32 is exact: a 16-bit shift) plus
# the sign-extended residual added to its int32 view.


def _may_hold_nan(xc: torch.Tensor) -> bool:
    """Whether the NaN fix-up is needed. On CPU a sum (NaN if any element is NaN, or if both
    infinities occur: then the fix-up runs for nothing) is much cheaper than ``isnan``; on
    accelerators the fix-up always runs, which costs no host synchronisation."""
    return xc.device.type != "cpu" or bool(torch.isnan(xc.sum()))


def _scratch(n: int, like: torch.Tensor, scratch: torch.Tensor | None) -> torch.Tensor:
    if scratch is not None and scratch.numel() >= min(n, CHUNK):
        return scratch
    return torch.empty(min(n, CHUNK), dtype=torch.int32, device=like.device)


def _high_bits(xc: torch.Tensor, t: torch.Tensor, nan: torch.Tensor | None) -> torch.Tensor:
    """int32 ``t`` := each element's rounded high half, NaN (where ``nan``) made quiet, sign kept."""
    xi = xc.view(torch.int32)
    torch.add(xi, 0x8000, out=t)
    t.bitwise_right_shift_(16)  # arithmetic shift: the sign half comes out right
    if nan is not None:
        torch.where(nan, torch.bitwise_right_shift(xi, 16).bitwise_or_(_QUIET), t, out=t)
    return t


def _nan_mask(xc: torch.Tensor) -> torch.Tensor | None:
    return torch.isnan(xc) if _may_hold_nan(xc) else None


def split_into(x: torch.Tensor, high: torch.Tensor, low: torch.Tensor,
               scratch: torch.Tensor | None = None) -> None:
    """Write ``x``'s split into ``high`` (bf16) and ``low`` (int16), chunk by chunk. ``scratch``:
    an optional int32 buffer of ``min(len, CHUNK)`` elements to reuse."""
    work = _scratch(x.numel(), x, scratch)
    for a in range(0, x.numel(), CHUNK):
        xc = x[a:a + CHUNK]
        nan = _nan_mask(xc)
        high[a:a + CHUNK].view(torch.int16).copy_(_high_bits(xc, work[:xc.numel()], nan))
        lw = low[a:a + CHUNK]
        lw.copy_(xc.view(torch.int32))  # truncation to int16: the low 16 bits
        if nan is not None:
            lw.masked_fill_(nan, 0)


def merge_into(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Write the fp32 values of ``(high, low)`` into ``out``; return ``out``."""
    work = _scratch(out.numel(), out, scratch)
    for a in range(0, out.numel(), CHUNK):
        oc = out[a:a + CHUNK]
        oc.copy_(high[a:a + CHUNK])
        t = work[:oc.numel()]
        t.copy_(low[a:a + CHUNK])
        oc.view(torch.int32).add_(t)
    return out


def round_like_shared(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The bf16 that ``split_into`` would keep as the high half, written into ``out`` (bf16):
    what a separate bf16 copy must hold for a run to match shared storage bit for bit."""
    work = _scratch(x.numel(), x, None)
    for a in range(0, x.numel(), CHUNK):
        xc = x[a:a + CHUNK]
        out[a:a + CHUNK].view(torch.int16).copy_(_high_bits(xc, work[:xc.numel()], _nan_mask(xc)))
    return out
