"""ZeRO++'s quantized collectives: int8 codes and an fp32 scale per block of ``BLOCK`` elements on the wire.

**qwZ** (``zero_optimization.zero_quantized_weights``, ``gather``): stage 3's training gathers. Each rank quantizes
the shard it sends (the compute-dtype values an exact gather would send) in blocks of ``BLOCK`` consecutive elements:
``scale = max |x| / 127`` in fp32 (1 for an all-zero block), ``code = round(x / scale)`` in int8, the shard's last
block padded with zeros. Two all-gathers run: the codes (``blocks * BLOCK`` bytes a rank) and the scales (4 bytes a
block), then every rank, its own part included, writes ``code * scale`` into the gathered buffer in the compute dtype.
So every rank computes with the same weights, and each differs from the exact value by at most half a step of its
block: ``|w - code * scale| <= max |x| / 254`` (plus the compute dtype's own rounding of the product). The shards,
masters and optimizer states stay exact: the error is in the forward's and backward's weights only, recomputed each
gather, and does not accumulate.

**qgZ** (``zero_optimization.zero_quantized_gradients``, ``reduce_scatter_rows``): the gradients' reduce-scatter
(stages 1-3). Each rank quantizes each row of its bucket (row r: what rank r owns) in the same blocks; two
all-to-alls bring every rank's row r to rank r (codes, scales); rank r dequantizes each in fp32, sums them in rank
order, and writes (or adds) the sum times the scale into its gradient shard. Each element's error is at most the sum
over ranks of half a step of that rank's block, ``sum_r max |g_r| / 254``, times the scale; the fp32 accumulation and
the optimizer see it once per reduction.

Bytes on the wire per element: 1 + 4 / ``BLOCK`` (1.016 for 256) against 2 (bf16) or 4 (fp32). Memory while a
collective is in flight: the codes of every rank (rounded up to whole blocks a rank) and the scales, ledger
``comm_buffer``, freed when it lands; quantizing and dequantizing one rank's part holds an fp32 copy of it for the
moment it runs. See note: qwz; see note: qgz (docs/design-notes.md).
"""
from __future__ import annotations

import torch

from ..collectives import AllGather, Collectives, Handle
from ..ledger import Category, Ledger
from .master_store import _Resident

BLOCK = 256  # elements per scale (DeepSpeed's qwZ default group size)


def blocks(n: int) -> int:
    """Blocks of ``BLOCK`` covering ``n`` elements."""
    return -(-n // BLOCK)


def quantize(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """``values`` (n elements, any float dtype) into ``codes`` (``blocks(n) * BLOCK`` int8, the tail zero) and
    ``scales`` (``blocks(n)`` fp32)."""
    n, count = values.numel(), scales.numel()
    x = torch.zeros(count * BLOCK, dtype=torch.float32, device=values.device)
    x[:n].copy_(values.reshape(-1))
    x = x.view(count, BLOCK)
    step = x.abs().amax(dim=1).div_(127.0)
    step = torch.where(step > 0, step, torch.ones_like(step))
    scales.copy_(step)
    codes.view(count, BLOCK).copy_(x.div_(step[:, None]).round_().clamp_(-127, 127))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``codes * scales`` block by block into ``out`` (its ``numel`` elements: the padding's codes are dropped)."""
    count = scales.numel()
    values = codes.view(count, BLOCK).to(torch.float32).mul_(scales[:, None])
    out.copy_(values.view(-1)[:out.numel()])


def gather(group: AllGather, full: torch.Tensor, source: torch.Tensor | QuantizedShard, ledger: Ledger) -> Handle:
    """Start the quantized all-gather of every rank's ``source`` (``full.numel() / group.size`` elements, or their
    codes already: ``QuantizedShard``) into ``full``; the returned handle's ``wait()`` lands both collectives and
    dequantizes (the module docstring)."""
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
    count, chunk i to rank i): issued at construction, ``sums(parts)`` waits and returns, for each of the ``parts``
    row positions of a chunk, the fp32 sum over the chunks received. The send buffers are held to the landing on every
    backend (the estimate's groups hold nothing)."""

    def __init__(self, group: Collectives, rows: list[torch.Tensor], c: int, ledger: Ledger) -> None:
        self.count, self.c = blocks(c), c
        device = rows[0].device
        n, width = len(rows), self.count * BLOCK
        self.sent = [ledger.empty(n * width, torch.int8, Category.COMM_BUFFER, device),
                     ledger.empty(n * self.count, torch.float32, Category.COMM_BUFFER, device)]
        codes, scales = self.sent
        with torch.no_grad():
            for i, row in enumerate(rows):
                quantize(row, codes[i * width:(i + 1) * width], scales[i * self.count:(i + 1) * self.count])
        self.codes = ledger.track(torch.empty_like(codes), Category.COMM_BUFFER)
        self.scales = ledger.track(torch.empty_like(scales), Category.COMM_BUFFER)
        self.handles = [group.all_to_all(self.scales, scales), group.all_to_all(self.codes, codes)]
        self.size = group.size

    def sums(self, parts: int) -> torch.Tensor:
        """``(parts, c)`` fp32: row j is the sum over the received chunks of their row j, in chunk order."""
        for handle in self.handles:
            handle.wait()
        self.handles, self.sent = [], []
        width, count = self.count * BLOCK, self.count
        total = torch.zeros(parts, self.c, dtype=torch.float32, device=self.codes.device)
        part = torch.empty(self.c, dtype=torch.float32, device=self.codes.device)
        with torch.no_grad():
            for i in range(self.size * parts):
                dequantize(self.codes[i * width:(i + 1) * width], self.scales[i * count:(i + 1) * count], part)
                total[i % parts].add_(part)
        return total


def _landed(target: torch.Tensor, total: torch.Tensor, scale: float, accumulate: bool) -> None:
    if accumulate:
        target.add_(total, alpha=scale)
    else:
        torch.mul(total, scale, out=target)


def reduce_scatter_rows(group: Collectives, rows: torch.Tensor, target: torch.Tensor, scale: float,
                        accumulate: bool, ledger: Ledger, nodes: tuple[Collectives, Collectives] | None = None
                        ) -> Handle:
    """qgZ: the sum over ranks of row ``group.rank`` of every rank's ``rows`` (``(size, c)``, any strides), times
    ``scale``, written into ``target`` (``c`` elements) or added into it (``accumulate``) when the handle is waited on;
    int8 codes and block scales on the wire (the module docstring). ``nodes``: (this rank's node, the ranks at its
    place in every node), for ``group``'s rank r = node index x L + place: two levels (``_two_levels``)."""
    size, c = rows.shape
    if nodes is not None:
        return _two_levels(nodes, rows, target, scale, accumulate, ledger)
    exchange = _Exchange(group, [rows[r] for r in range(size)], c, ledger)
    return Handle(None, lambda: _landed(target, exchange.sums(1)[0], scale, accumulate))


def _two_levels(nodes: tuple[Collectives, Collectives], rows: torch.Tensor, target: torch.Tensor, scale: float,
                accumulate: bool, ledger: Ledger) -> Handle:
    """Hierarchical qgZ over M nodes of L ranks: each rank sends each node peer p the rows of the M ranks at place p
    (quantized), and sums what its peers sent it (the node's partial sums for the ranks at its own place, fp32); when
    that lands the M partial sums are quantized again and sent, one to each node's rank at this place, which sums
    them. Across nodes each rank sends M rows instead of L x M, at the cost of a second quantization."""
    node, across = nodes
    L, M, c = node.size, across.size, rows.shape[1]
    first = _Exchange(node, [rows[m * L + p] for p in range(L) for m in range(M)], c, ledger)

    def land() -> None:
        partial = first.sums(M)  # row m: this node's sum for the rank at this place in node m
        second = _Exchange(across, [partial[m] for m in range(M)], c, ledger)
        del partial
        _landed(target, second.sums(1)[0], scale, accumulate)

    return Handle(None, land)
