"""fp8 (e4m3) values with one power-of-two scale per block of elements: how an optimizer state is kept in 8 bits.

``quantize(x, values, scales, block)``: each run of ``block`` elements of ``x`` (counted from its start; the last
may be shorter) gets the smallest power of two ``s`` with ``max|x| / s <= 448`` (e4m3's largest finite value; 1
for a block of zeros), and its values ``x / s`` rounded to nearest e4m3. ``dequantize_into(out, values, scales,
block)`` writes ``values * s`` back. Power-of-two scales (as the MX formats' shared exponents) make both
directions exact apart from the rounding to e4m3: ``x / s`` and ``q * s`` are exact in fp32, so a dequantized
block quantized again with its own blocks gives the same real values (the scale may come out smaller by powers of
two, the values then larger by as much), and every dequantized value is exactly a bf16 value (four significant
bits, fp32's exponents). A state saved dequantized and loaded by as many ranks is the state it was; loaded by
another number of ranks its blocks group other elements, and requantizing rounds again (documented there).
Rounding to nearest, or stochastically (unbiased, as bf16's: ``stochastic``), which an exponential average needs
in 3 mantissa bits: an update smaller than half a step (6% of the value) would otherwise be lost every time.
The scales are fp32 (``fp8``: blocks of 128 or 256) or e8m0 (``mxfp8``: the OCP MX format's shared scale, one byte,
blocks of 32), the same powers of two either way (an e8m0 scale no smaller than 2^-127). The MX specification's own
conversion picks the scale from the block's largest exponent and clips what exceeds 448; this one picks the smallest
scale that clips nothing, so each value is rounded once and never clipped.
Memory: 1 byte an element, 4 bytes a block for an fp32 scale (128 elements: 1.03 bytes an element), 1 for an e8m0
one (32 elements: 1.03). The step
works through fp32 temporaries of the chunk it is given. Held by ``tests/optim/test_fp8_states.py``.
"""
from __future__ import annotations

import torch

from .stochastic_round import random_bits

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E8M0 = torch.float8_e8m0fnu  # the MX formats' shared scale: a power of two, 2^-127 to 2^127, one byte
MX_BLOCK = 32  # elements per scale in the MX formats (mxfp8: e4m3 values, an e8m0 scale per 32)


def blocks(numel: int, block: int) -> int:
    """How many scales a state of ``numel`` elements has."""
    return -(-numel // block)


def quantize(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int,
             step: torch.Tensor | None = None, work: torch.Tensor | None = None) -> None:
    """``x`` (fp32, any length; scratch afterwards) into ``values`` (e4m3, as long) and ``scales`` (fp32, one per
    block of ``block`` elements from ``x``'s start). ``step`` given: stochastic rounding (``stochastic``), with
    ``work`` two int32 rows as long as ``x`` where given."""
    n = x.numel()
    full = n // block * block
    if full:
        _scale_blocks(x[:full].view(-1, block), scales[:full // block])
    if full < n:
        _scale_blocks(x[full:].view(1, -1), scales[full // block:])
    if step is not None:
        stochastic(x, step, work)
    values.copy_(x)


def _scale_blocks(x: torch.Tensor, scales: torch.Tensor) -> None:
    """Each row's power-of-two scale into ``scales`` (fp32, or e8m0: no smaller than 2^-127, where a smaller block's
    values round as e4m3 subnormals); the row divided by it, in place."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=1)  # (max |x|, no |x| the size of the chunk made)
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax / 448 = m * 2^e, m in [0.5, 1)
    exponent -= (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    if scales.dtype == E8M0:
        exponent.clamp_(min=-127)
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    scale[amax == 0] = 1.0
    scales.copy_(scale)
    x.div_(scale.unsqueeze(1))


def stochastic(y: torch.Tensor, step: torch.Tensor, work: torch.Tensor | None = None) -> None:
    """``y`` (fp32, within e4m3's range) rounded in place to an e4m3 value, up with probability equal to its distance
    from the one below (unbiased), by a hash of its bits and ``step`` (``stochastic_round.random_bits``: the same on
    any layout): 16 random bits added to the 20 fp32 mantissa bits e4m3 drops, then truncated. Below e4m3's smallest
    normal (2^-6 of the block's scale, 1/28672 of its largest) the cast that follows rounds to nearest."""
    n = y.numel()
    out, tmp = (None, None) if work is None else (work[0, :n], work[1, :n])
    bits = random_bits(y, step, out, tmp).bitwise_left_shift_(4).add_(y.view(torch.int32))
    y.copy_(bits.bitwise_and_(~0xFFFFF).view(torch.float32)).clamp_(-E4M3_MAX, E4M3_MAX)


def root_(x: torch.Tensor) -> torch.Tensor:
    """The square root of fp32 ``x`` in place, correctly rounded (IEEE's, as C's ``sqrtf``), and ``x``: what the
    second moment is stored as. torch's CPU ``sqrt`` is MKL's vector function, within a unit in the last place (20%
    of values a unit off here, 2026-12-06); the root taken in double (within a unit of double's last place) and
    rounded once is the correctly rounded one: an fp32 value's exact root is never within 2^-50 of it of a midpoint
    between two fp32 values (the midpoint's square has 49 or more significant bits, the value 24), four times
    double's error. Memory: a double copy of ``x`` while it runs."""
    return x.copy_(x.double().sqrt_())


def dequantize_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``values * scale`` of each block into ``out`` (fp32, as long as ``values``); returns ``out``."""
    n = values.numel()
    full = n // block * block
    out.copy_(values)
    scales = scales if scales.dtype == torch.float32 else scales.float()  # (e8m0: exact, a byte a block read)
    if full:
        out[:full].view(-1, block).mul_(scales[:full // block].unsqueeze(1))
    if full < n:
        out[full:].mul_(scales[full // block])
    return out
