"""fp32 values stored in bf16, rounded to nearest or stochastically, by a hash of the value and a step count.

Stochastic rounding: the fp32 value's low 16 bits plus 16 random bits, then truncated, so a value rounds up with
probability equal to its distance from the bf16 value below it (unbiased). The random bits are a hash of the value's
own bits and the step count, not of a position: the same value at the same step rounds the same way whatever shard,
rank or layout holds it, so stochastic rounding is as reproducible and as layout-independent as rounding to nearest;
the step count changes the draw from step to step, so a value an update keeps returning to is not rounded the same
way every time. Infinities and NaNs stay what they are (a NaN whose payload lies only in its low 16 bits, which
arithmetic does not make, would become an infinity); a value within half a bf16 step of bf16's largest rounds up to
infinity as often as stochastic rounding says.

Memory: two int32 rows as long as the values (``work``), in place: a fresh buffer per operation cost 4x (page
faults). Used by the stored optimizer states (``zeroplus/optim/stored_states.py``) and bf16 master weights
(``zeroplus/zero/master_store.py``). See note: stored optimizer states (docs/design-notes.md).
"""
from __future__ import annotations

import torch

# odd 32-bit constants (MurmurHash3's finaliser and the golden ratio's), as signed int32; int32 products wrap
_GOLDEN = 0x9E3779B1 - (1 << 32)
_MIX1 = 0x85EBCA6B - (1 << 32)
_MIX2 = 0xC2B2AE35 - (1 << 32)


def random_bits(value: torch.Tensor, step: torch.Tensor, out: torch.Tensor | None = None,
                tmp: torch.Tensor | None = None) -> torch.Tensor:
    """16 pseudo-random bits (int32, 0..65535) per element of fp32 ``value``, a hash of its bits and the step count
    ``step`` (a 0-d tensor: nothing is read on the host); into ``out`` with ``tmp`` (int32, ``value``'s length)
    where given."""
    bits = value.view(torch.int32)
    out = torch.empty_like(bits) if out is None else out
    tmp = torch.empty_like(bits) if tmp is None else tmp
    torch.bitwise_xor(bits, step.to(device=value.device, dtype=torch.int32) * _GOLDEN, out=out)
    out.mul_(_MIX1)
    torch.bitwise_right_shift(out, 13, out=tmp)
    out.bitwise_xor_(tmp).mul_(_MIX2)
    return out.bitwise_right_shift_(16).bitwise_and_(0xFFFF)


def store(dst: torch.Tensor, value: torch.Tensor, rounding: str, step: torch.Tensor,
          work: torch.Tensor | None = None) -> None:
    """Write fp32 ``value`` into ``dst`` (its dtype), rounded as ``rounding`` says: ``nearest`` (torch's cast) or, for
    a bf16 ``dst``, ``stochastic`` (``step``: the step count; ``work``: two int32 rows of at least ``value``'s
    length, else made here)."""
    if rounding == "nearest" or dst.dtype != torch.bfloat16:
        dst.copy_(value)
        return
    n = value.numel()
    out, tmp = (None, None) if work is None else (work[0, :n], work[1, :n])
    up = random_bits(value, step, out, tmp).add_(value.view(torch.int32))  # the magnitude's low bits plus the draw
    dst.view(torch.int16).copy_(up.bitwise_right_shift_(16))  # arithmetic shift: the sign stays; the low 16 bits
