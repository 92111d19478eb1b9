"""ZeRO++'s quantized collectives: int8 (or, for qgZ, int4) codes and an fp32 scale per block of ``BLOCK`` elements on
the wire.

**qwZ** (``zero_optimization.zero_quantized_weights``, ``gather``): stage 3's training gathers. Each rank quantizes
the shard it sends (the compute-dtype values an exact gather would send) in blocks of ``BLOCK`` consecutive elements:
``scale = max |x| / 127`` in fp32 (1 for an all-zero block), ``code = round(x / scale)`` in int8, the shard's last
block padded with zeros. Two all-gathers run: the codes (``blocks * BLOCK`` bytes a rank) and the scales (4 bytes a
block), then every rank, its own part included, writes ``code * scale`` into the gathered buffer in the compute dtype.
So every rank computes with the same weights, and each differs from the exact value by at most half a step of its
block: ``|w - code * scale| <= max |x| / 254`` (plus the compute dtype's own rounding of the product). The shards,
masters and optimizer states stay exact: the error is in the forward's and backward's weights only, recomputed each
gather, and does not accumulate.

With ``zeroplus.quantized_weights_dtype`` the gathers carry other codes (``WEIGHT_DTYPES``), each rank still
quantizing its own shard and every rank writing the same values: ``"fp8"``, e4m3 values with a power-of-two fp32 scale
per ``FP8_BLOCK`` elements of each shard (``kernels/block_fp8.py``: each weight within ``|w| / 16``, or ``s / 1024``
below e4m3's normal range, ``s`` its block's scale; 1.031 bytes an element), or ``"bf16"``, the shard rounded to
nearest bf16 (``|w| / 256``; 2 bytes): the compute dtype FSDP2's ``param_dtype`` gathers in, here for fp32 masters
and compute. In a bf16 compute dtype the shard already is bf16, so ``"bf16"`` gathers it exactly.

**qgZ** (``zero_optimization.zero_quantized_gradients``, ``reduce_scatter_rows``): the gradients' reduce-scatter
(stages 1-3). Each rank quantizes each row of its bucket (row r: what rank r owns) in the same blocks; two
all-to-alls bring every rank's row r to rank r (codes, scales); rank r dequantizes each in fp32, sums them in rank
order, and writes (or adds) the sum times the scale into its gradient shard. Each element's error is at most the sum
over ranks of half a step of that rank's block, ``sum_r max |g_r| / 254``, times the scale; the fp32 accumulation and
the optimizer see it once per reduction. With ``zeroplus.quantized_gradient_bits`` 4 (DeepSpeed's qgZ sends int4)
the codes are ``round(x / scale)`` with ``scale = max |x| / 7``, two to a byte (the element of even index in the low
four bits, two's complement), so each rank's error is at most ``max |g_r| / 14`` of its block: 18 times int8's, for
half the bytes.

Bytes on the wire per element: 1 + 4 / ``BLOCK`` (1.016 for 256; int4: 0.516) against 2 (bf16) or 4 (fp32).
Memory while a collective is in flight: the codes of every rank (rounded up to whole blocks a rank) and the scales,
ledger ``comm_buffer``, freed when it lands; quantizing and dequantizing one rank's part holds an fp32 copy of it for
the moment it runs. See note: qwz; see note: qgz (docs/design-notes.md).
"""
from __future__ import annotations

import torch

from ..collectives import AllGather, Collectives, Handle
from ..kernels import block_fp8
from ..ledger import Category, Ledger
from .master_store import _Resident

BLOCK = 256  # elements per scale (DeepSpeed's qwZ default group size)
LEVELS = {8: 127, 4: 7}  # the largest code of each width (symmetric: -LEVELS .. LEVELS)
WEIGHT_DTYPES = ("int8", "fp8", "bf16")  # qwZ's codes on the wire (zeroplus.quantized_weights_dtype)
FP8_BLOCK = 128  # elements of a shard per fp8 gather's scale


def blocks(n: int) -> int:
    """Blocks of ``BLOCK`` covering ``n`` elements."""
    return -(-n // BLOCK)


def code_bytes(count: int, bits: int = 8) -> int:
    """Bytes of the codes of ``count`` blocks at ``bits`` a code."""
    return count * BLOCK * bits // 8


def quantize(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int = 8) -> None:
    """``values`` (n elements, any float dtype) into ``codes`` (``code_bytes(blocks(n), bits)`` int8, the tail zero;
    at 4 bits two codes a byte) and ``scales`` (``blocks(n)`` fp32)."""
    n, count, top = values.numel(), scales.numel(), LEVELS[bits]
    x = torch.zeros(count * BLOCK, dtype=torch.float32, device=values.device)
    x[:n].copy_(values.reshape(-1))
    x = x.view(count, BLOCK)
    step = x.abs().amax(dim=1).div_(float(top))
    step = torch.where(step > 0, step, torch.ones_like(step))
    scales.copy_(step)
    q = x.div_(step[:, None]).round_().clamp_(-top, top)
    if bits == 8:
        codes.view(count, BLOCK).copy_(q)
        return
    pairs = q.to(torch.int8).view(count, BLOCK // 2, 2)  # (the even element low, the odd one high)
    torch.bitwise_or(pairs[..., 0].bitwise_and(15), pairs[..., 1].bitwise_left_shift(4),
                     out=codes.view(count, BLOCK // 2))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int = 8) -> None:
    """``codes * scales`` block by block into ``out`` (its ``numel`` elements: the padding's codes are dropped)."""
    count = scales.numel()
    if bits == 8:
        q = codes.view(count, BLOCK).to(torch.float32)
    else:  # the low four bits sign-extended by (n ^ 8) - 8, the high four by an arithmetic shift
        packed = codes.view(count, BLOCK // 2)
        q = torch.stack([packed.bitwise_and(15).bitwise_xor_(8).sub_(8), packed.bitwise_right_shift(4)], dim=2)
        q = q.view(count, BLOCK).to(torch.float32)
    out.copy_(q.mul_(scales[:, None]).view(-1)[:out.numel()])


def gather(group: AllGather, full: torch.Tensor, source: torch.Tensor | QuantizedShard, ledger: Ledger,
           dtype: str = "int8") -> Handle:
    """Start the quantized all-gather of every rank's ``source`` (``full.numel() / group.size`` elements, or their
    codes already: ``QuantizedShard``) into ``full`` as codes of ``dtype`` (``WEIGHT_DTYPES``; a ``QuantizedShard``
    sends its int8 codes); the returned handle's ``wait()`` lands the collectives and dequantizes (the module
    docstring)."""
    if dtype == "bf16" and not isinstance(source, QuantizedShard):
        return _gather_bf16(group, full, source, ledger)
    if dtype == "fp8" and not isinstance(source, QuantizedShard):
        return _gather_fp8(group, full, source, ledger)
    n, size = source.numel if isinstance(source, QuantizedShard) else source.numel(), group.size
    count = blocks(n)
    device = full.device
    codes = ledger.empty(size * count * BLOCK, torch.int8, Category.COMM_BUFFER, device)
    scales = ledger.empty(size * count, torch.float32, Category.COMM_BUFFER, device)
    mine_codes = codes[group.rank * count * BLOCK:(group.rank + 1) * count * BLOCK]
    mine_scales = scales[group.rank * count:(group.rank + 1) * count]
    with torch.no_grad():
        if isinstance(source, QuantizedShard):
            mine_codes.copy_(source.codes)
            mine_scales.copy_(source.scales)
        else:
            quantize(source, mine_codes, mine_scales)
    handles = [group.all_gather(scales, mine_scales), group.all_gather(codes, mine_codes)]

    def land() -> None:
        for handle in handles:
            handle.wait()
        with torch.no_grad():
            for r in range(size):
                dequantize(codes[r * count * BLOCK:(r + 1) * count * BLOCK], scales[r * count:(r + 1) * count],
                           full[r * n:(r + 1) * n])
        handles.clear()

    return Handle(None, land)


def _gather_bf16(group: AllGather, full: torch.Tensor, source: torch.Tensor, ledger: Ledger) -> Handle:
    """``gather`` of bf16 values: every rank's shard rounded to nearest bf16, written into ``full``."""
    n, size = source.numel(), group.size
    sent = ledger.empty(size * n, torch.bfloat16, Category.COMM_BUFFER, full.device)
    mine = sent[group.rank * n:(group.rank + 1) * n]
    with torch.no_grad():
        mine.copy_(source.reshape(-1))
    handle = group.all_gather(sent, mine)

    def land() -> None:
        handle.wait()
        with torch.no_grad():
            full[:size * n].copy_(sent)

    return Handle(None, land)


def _gather_fp8(group: AllGather, full: torch.Tensor, source: torch.Tensor, ledger: Ledger) -> Handle:
    """``gather`` of e4m3 values with a power-of-two fp32 scale per ``FP8_BLOCK`` elements of each shard (sent as
    bytes: gloo has no fp8 type), written into ``full`` (through an fp32 copy of one part where ``full`` is not
    fp32)."""
    n, size = source.numel(), group.size
    count = block_fp8.blocks(n, FP8_BLOCK)
    values = ledger.empty(size * n, block_fp8.E4M3, Category.COMM_BUFFER, full.device)
    scales = ledger.empty(size * count, torch.float32, Category.COMM_BUFFER, full.device)
    mine_values = values[group.rank * n:(group.rank + 1) * n]
    mine_scales = scales[group.rank * count:(group.rank + 1) * count]
    with torch.no_grad():
        block_fp8.quantize(source.reshape(-1).to(torch.float32, copy=True), mine_values, mine_scales, FP8_BLOCK)
    handles = [group.all_gather(scales, mine_scales),
               group.all_gather(values.view(torch.uint8), mine_values.view(torch.uint8))]

    def land() -> None:
        for handle in handles:
            handle.wait()
        with torch.no_grad():
            for r in range(size):
                part = full[r * n:(r + 1) * n]
                out = part if part.dtype == torch.float32 else torch.empty(n, dtype=torch.float32, device=full.device)
                block_fp8.dequantize_into(out, values[r * n:(r + 1) * n], scales[r * count:(r + 1) * count],
                                          FP8_BLOCK)
                if out is not part:
                    part.copy_(out)
        handles.clear()

    return Handle(None, land)


class QuantizedShard(_Resident):
    """A frozen group's shard kept as int8 codes and fp32 block scales (``zero_quantized_nontrainable_weights``: about
    1.016 bytes an element instead of the compute dtype's), as the group's master store: reads dequantize; a write
    (a checkpoint or pretrained load, ``GatheredParameters(modifier_rank=...)``) dequantizes the blocks it touches,
    overwrites its elements and quantizes those blocks again (their other elements within half their new step of what
    they held); gathers send the codes as they are (``gather``). Ledger ``param``."""

    shared = False
    copied = True
    scratch_rows = 1

    def __init__(self, values: torch.Tensor, ledger: Ledger) -> None:
        self.numel = values.numel()
        count = blocks(self.numel)
        self.codes = ledger.empty(count * BLOCK, torch.int8, Category.PARAM, values.device)
        self.scales = ledger.empty(count, torch.float32, Category.PARAM, values.device)
        with torch.no_grad():
            quantize(values, self.codes, self.scales)

    def _blocks(self, a: int, b: int) -> tuple[int, int, torch.Tensor]:
        """The blocks covering elements ``[a, b)``: (first block, last block + 1, their values in fp32)."""
        lo, hi = a // BLOCK, blocks(b)
        out = torch.empty((hi - lo) * BLOCK, dtype=torch.float32, device=self.codes.device)
        dequantize(self.codes[lo * BLOCK:hi * BLOCK], self.scales[lo:hi], out)
        return lo, hi, out

    def read(self, a: int, b: int) -> torch.Tensor:
        lo, _, values = self._blocks(a, b)
        return values[a - lo * BLOCK:b - lo * BLOCK]

    def read_into(self, a: int, b: int, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
        return out.copy_(self.read(a, b))

    def write(self, at: int, values: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
        lo, hi, block_values = self._blocks(at, at + values.numel())
        block_values[at - lo * BLOCK:at - lo * BLOCK + values.numel()].copy_(values.reshape(-1))
        with torch.no_grad():
            quantize(block_values, self.codes[lo * BLOCK:hi * BLOCK], self.scales[lo:hi])

    def to_compute(self, dst: torch.Tensor) -> torch.Tensor:
        _, _, values = self._blocks(0, self.numel)
        return dst.copy_(values[:self.numel])


class _Exchange:
    """One quantized all-to-all of ``len(rows)`` rows of ``c`` elements over ``group`` (the rows in chunks of equal
    count, chunk i to rank i), codes of ``bits``: issued at construction, ``sums(parts)`` waits and returns, for each
    of the ``parts`` row positions of a chunk, the fp32 sum over the chunks received. The send buffers are held to the
    landing on every backend (the estimate's groups hold nothing)."""

    def __init__(self, group: Collectives, rows: list[torch.Tensor], c: int, ledger: Ledger, bits: int) -> None:
        self.count, self.c, self.bits = blocks(c), c, bits
        device = rows[0].device
        n, width = len(rows), code_bytes(self.count, bits)
        self.sent = [ledger.empty(n * width, torch.int8, Category.COMM_BUFFER, device),
                     ledger.empty(n * self.count, torch.float32, Category.COMM_BUFFER, device)]
        codes, scales = self.sent
        with torch.no_grad():
            for i, row in enumerate(rows):
                quantize(row, codes[i * width:(i + 1) * width], scales[i * self.count:(i + 1) * self.count], bits)
        self.codes = ledger.track(torch.empty_like(codes), Category.COMM_BUFFER)
        self.scales = ledger.track(torch.empty_like(scales), Category.COMM_BUFFER)
        self.handles = [group.all_to_all(self.scales, scales), group.all_to_all(self.codes, codes)]
        self.size = group.size

    def sums(self, parts: int) -> torch.Tensor:
        """``(parts, c)`` fp32: row j is the sum over the received chunks of their row j, in chunk order."""
        for handle in self.handles:
            handle.wait()
        self.handles, self.sent = [], []
        width, count = code_bytes(self.count, self.bits), self.count
        total = torch.zeros(parts, self.c, dtype=torch.float32, device=self.codes.device)
        part = torch.empty(self.c, dtype=torch.float32, device=self.codes.device)
        with torch.no_grad():
            for i in range(self.size * parts):
                dequantize(self.codes[i * width:(i + 1) * width], self.scales[i * count:(i + 1) * count], part,
                           self.bits)
                total[i % parts].add_(part)
        return total


def _landed(target: torch.Tensor, total: torch.Tensor, scale: float, accumulate: bool) -> None:
    if accumulate:
        target.add_(total, alpha=scale)
    else:
        torch.mul(total, scale, out=target)


def reduce_scatter_rows(group: Collectives, rows: torch.Tensor, target: torch.Tensor, scale: float,
                        accumulate: bool, ledger: Ledger, nodes: tuple[Collectives, Collectives] | None = None,
                        bits: int = 8) -> Handle:
    """qgZ: the sum over ranks of row ``group.rank`` of every rank's ``rows`` (``(size, c)``, any strides), times
    ``scale``, written into ``target`` (``c`` elements) or added into it (``accumulate``) when the handle is waited on;
    codes of ``bits`` (8 or 4) and block scales on the wire (the module docstring). ``nodes``: (this rank's node, the
    ranks at its place in every node), for ``group``'s rank r = node index x L + place: two levels (``_two_levels``)."""
    size, c = rows.shape
    if nodes is not None:
        return _two_levels(nodes, rows, target, scale, accumulate, ledger, bits)
    exchange = _Exchange(group, [rows[r] for r in range(size)], c, ledger, bits)
    return Handle(None, lambda: _landed(target, exchange.sums(1)[0], scale, accumulate))


def _two_levels(nodes: tuple[Collectives, Collectives], rows: torch.Tensor, target: torch.Tensor, scale: float,
                accumulate: bool, ledger: Ledger, bits: int) -> Handle:
    """Hierarchical qgZ over M nodes of L ranks: each rank sends each node peer p the rows of the M ranks at place p
    (quantized), and sums what its peers sent it (the node's partial sums for the ranks at its own place, fp32); when
    that lands the M partial sums are quantized again and sent, one to each node's rank at this place, which sums
    them. Across nodes each rank sends M rows instead of L x M, at the cost of a second quantization."""
    node, across = nodes
    L, M, c = node.size, across.size, rows.shape[1]
    first = _Exchange(node, [rows[m * L + p] for p in range(L) for m in range(M)], c, ledger, bits)

    def land() -> None:
        partial = first.sums(M)  # row m: this node's sum for the rank at this place in node m
        second = _Exchange(across, [partial[m] for m in range(M)], c, ledger, bits)
        del partial
        _landed(target, second.sums(1)[0], scale, accumulate)

    return Handle(None, land)
