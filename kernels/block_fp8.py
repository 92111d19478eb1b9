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
Memory: 1 byte an element, 4 bytes a block for its scale (128 elements: 1.03 bytes an element). The step
works through fp32 temporaries of the chunk it is given. Held by ``tests/optim/test_fp8_states.py``.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def blocks(numel: int, block: int) -> int:
    """How many scales a state of ``numel`` elements has."""
    return -(-numel // block)


def quantize(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """``x`` (fp32, any length; scratch afterwards) into ``values`` (e4m3, as long) and ``scales`` (fp32, one per
    block of ``block`` elements from ``x``'s start)."""
    n = x.numel()
    full = n // block * block
    if full:
        _quantize_blocks(x[:full].view(-1, block), values[:full].view(-1, block), scales[:full // block])
    if full < n:
        _quantize_blocks(x[full:].view(1, -1), values[full:].view(1, -1), scales[full // block:])


def _quantize_blocks(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    amax = x.abs().amax(dim=1)
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax / 448 = m * 2^e, m in [0.5, 1)
    exponent -= (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    scale[amax == 0] = 1.0
    scales.copy_(scale)
    values.copy_(x.div_(scale.unsqueeze(1)))


def dequantize_into(out: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """``values * scale`` of each block into ``out`` (fp32, as long as ``values``); returns ``out``."""
    n = values.numel()
    full = n // block * block
    out.copy_(values)
    if full:
        out[:full].view(-1, block).mul_(scales[:full // block].unsqueeze(1))
    if full < n:
        out[full:].mul_(scales[full // block])
    return out
