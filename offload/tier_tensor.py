"""A 1-D tensor that lives on a tier for good, read and rewritten by ranges: offloaded parameter
shards (``offload_param``), whose every gather reads them and whose every step rewrites them.

``keep(tier, t)`` moves ``t`` to the tier and returns a ``TierTensor``:

- ``read(a, b, out=None)`` starts bringing elements ``[a, b)`` back and returns a pending read;
  its ``result()`` is the range on the device (in ``out`` when given). Reads never consume the
  tier's copy.
- ``write(at, values)`` starts replacing elements from ``at`` with ``values`` and returns at
  once; the tier owns ``values`` until the write is done, so the caller must not change it.
  A read waits for every earlier write (a read after a step sees the step's values).

Backends:

- host tier with an accelerator: one pinned host tensor; ranges are copied on the tier's side
  streams with events (the device waits only for its own range). On a CPU-only machine the host
  is the device: the tensor stays as it is, reads are views (no copy), and nothing is saved.
- file tier: one file per tensor in the tier's per-process directory, read with ``preadv`` into
  the destination buffer and written with ``pwrite`` on the tier's read and write thread pools (or, by rows,
  ``read_rows``/``write_rows`` in the calling thread: a row cache's scattered misses),
  space reserved up front (``posix_fallocate``) so a full disk fails at ``keep``, not in the middle
  of a step.

Memory: the host backend holds ``nbytes`` of host memory; the file backend holds none between
uses, a read's destination until its consumer drops it, and each write's ``values`` until the
write lands (at most ``max_writes`` of them: the next write waits for the oldest).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
from typing import Any

import torch

from . import integrity
from .tiers import FileTier, HostTier, Tier

_names = itertools.count()


class _Done:
    """A read that needed no transfer."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


class _DeviceRead:
    """A host-to-device copy in flight on a side stream."""

    def __init__(self, value: torch.Tensor, event: Any, accel: Any) -> None:
        self.value, self.event, self.accel = value, event, accel

    def result(self) -> torch.Tensor:
        self.event.wait(self.accel.current_stream())
        self.value.record_stream(self.accel.current_stream())
        return self.value


class _FileRead:
    """A file read on the tier's pool; moved to the device (if not the host) on ``result``."""

    def __init__(self, future: concurrent.futures.Future, device: torch.device, out: torch.Tensor | None) -> None:
        self.future, self.device, self.out = future, device, out

    def result(self) -> torch.Tensor:
        host = self.future.result()
        if self.device.type == "cpu":
            return host
        return self.out.copy_(host) if self.out is not None else host.to(self.device)


class HostTierTensor:
    def __init__(self, tier: HostTier, t: torch.Tensor) -> None:
        self.tier, self.numel, self.dtype, self.device = tier, t.numel(), t.dtype, t.device
        self.nbytes = self.numel * t.element_size()
        if not tier.saves_memory:
            self.data = t
            return
        self.data = tier.accel.pin_memory(torch.empty(self.numel, dtype=t.dtype))
        self.data.copy_(t)

    def read(self, a: int, b: int, out: torch.Tensor | None = None) -> _Done | _DeviceRead:
        if not self.tier.saves_memory:
            return _Done(self.data[a:b] if out is None else out.copy_(self.data[a:b]))
        accel, stream = self.tier.accel, self.tier._in_stream
        stream.wait_stream(self.tier._out_stream)  # earlier writes land first
        stream.wait_stream(accel.current_stream())  # and ``out``'s earlier users are done with it
        with accel.stream(stream):
            value = out if out is not None else torch.empty(b - a, dtype=self.dtype, device=self.device)
            value.copy_(self.data[a:b], non_blocking=True)
            event = accel.new_event()
            event.record(stream)
        return _DeviceRead(value, event, accel)

    def write(self, at: int, values: torch.Tensor) -> None:
        dst = self.data[at:at + values.numel()]
        if not self.tier.saves_memory:
            if dst.data_ptr() != values.data_ptr():
                dst.copy_(values)
            return
        accel, stream = self.tier.accel, self.tier._out_stream
        stream.wait_stream(accel.current_stream())
        with accel.stream(stream):
            dst.copy_(values, non_blocking=True)
            values.record_stream(stream)

    def read_rows(self, rows: list[int], width: int) -> torch.Tensor:
        """Rows ``rows`` of the tensor seen as ``(numel / width, width)``, gathered now, on the device."""
        with_device_writes_done(self)
        picked = self.data.view(-1, width)[torch.tensor(rows, dtype=torch.long)]
        return picked.to(self.device) if picked.device != self.device else picked

    def write_rows(self, rows: list[int], values: torch.Tensor) -> None:
        """Rows ``rows`` replaced with ``values`` (``len(rows) x width``), now."""
        with_device_writes_done(self)
        self.data.view(-1, values.shape[1])[torch.tensor(rows, dtype=torch.long)] = values.to(self.data.device)

    def close(self) -> None:
        del self.data  # (closed: nothing held)


class FileTierTensor:
    def __init__(self, tier: FileTier, t: torch.Tensor, max_writes: int = 4) -> None:
        self.tier, self.numel, self.dtype, self.device = tier, t.numel(), t.dtype, t.device
        self.itemsize = t.element_size()
        self.nbytes = self.numel * self.itemsize
        self.max_writes = max(1, max_writes)
        self.path = os.path.join(tier.directory, f"kept-{next(_names)}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if self.nbytes:
                os.posix_fallocate(self.fd, 0, self.nbytes)
        except OSError as err:
            os.close(self.fd)
            os.remove(self.path)
            raise OSError(err.errno, f"cannot reserve {self.nbytes} bytes in {tier.directory}: "
                                     f"{err.strerror}") from None
        self._writes: list[concurrent.futures.Future] = []
        # CRC-32 of the last write of each range (start, numel): a read of exactly that range checks it
        self._crc: dict[tuple[int, int], concurrent.futures.Future | int] = {(0, self.numel): _pwrite(
            self.fd, [_host(t)], 0)}

    def read(self, a: int, b: int, out: torch.Tensor | None = None) -> _FileRead:
        writes = list(self._writes)
        host = out if out is not None and out.device.type == "cpu" else torch.empty(b - a, dtype=self.dtype)
        crc = self._crc.get((a, b - a))
        return _FileRead(self.tier.read_pool.submit(self._read, a, host, writes, crc), self.device, out)

    def _read(self, a: int, host: torch.Tensor, writes: list[concurrent.futures.Future],
              crc: concurrent.futures.Future | int | None) -> torch.Tensor:
        for w in writes:
            w.result()
        view = host.view(torch.uint8).numpy().data
        got = os.preadv(self.fd, [view], a * self.itemsize)
        if got != view.nbytes:
            raise OSError(f"{self.path}: read {got} of {view.nbytes} bytes at element {a}")
        if crc is not None:
            integrity.verify(self.path, host, crc if isinstance(crc, int) else crc.result(),
                             f" (elements {a}..{a + host.numel()})")
        return host

    def write(self, at: int, values: torch.Tensor) -> None:
        self._writes = [w for w in self._writes if not w.done()]
        if len(self._writes) >= self.max_writes:
            self._writes.pop(0).result()
        future = self.tier.write_pool.submit(_pwrite, self.fd, [_host(values)], at * self.itemsize)
        numel = values.numel()
        for key in [k for k in self._crc if k[0] < at + numel and at < k[0] + k[1]]:
            del self._crc[key]  # overwritten, wholly or in part
        self._crc[(at, numel)] = future
        self._writes.append(future)

    def read_rows(self, rows: list[int], width: int) -> torch.Tensor:
        """Rows ``rows`` (sorted, distinct) of the tensor seen as ``(numel / width, width)``, read now in this
        thread after every earlier write: rows at most ``ROW_GAP`` apart in one ``preadv`` into one staging
        buffer (the rows between read and dropped), then picked out (no CRC check: partial ranges)."""
        for w in self._writes:
            w.result()
        spans = _spans(rows, ROW_GAP)
        total = sum(last - first + 1 for first, last, _ in spans)
        staging = torch.empty(total * width, dtype=self.dtype)
        raw = staging.view(torch.uint8).numpy().data
        row_bytes, at = width * self.itemsize, 0
        picks: list[int] = []
        for first, last, members in spans:
            n = last - first + 1
            got = os.preadv(self.fd, [raw[at * row_bytes:(at + n) * row_bytes]], first * row_bytes)
            if got != n * row_bytes:
                raise OSError(f"{self.path}: read {got} of {n * row_bytes} bytes at row {first}")
            picks.extend(at + r - first for r in members)
            at += n
        return staging.view(total, width)[torch.tensor(picks, dtype=torch.long)].to(self.device)

    def write_rows(self, rows: list[int], values: torch.Tensor) -> None:
        """Rows ``rows`` (sorted, distinct) replaced with ``values``, written now in this thread (after every
        earlier write): one ``pwrite`` per run of consecutive rows. The ranges' CRCs are forgotten."""
        for w in self._writes:
            w.result()
        self._writes = []
        host = _host(values)  # 1-D: the rows one after another
        row_bytes = host.numel() // max(1, len(rows)) * self.itemsize
        raw = host.view(torch.uint8).numpy().data
        i = 0
        for first, last, members in _spans(rows, 1):
            n = len(members)
            chunk, done = raw[i * row_bytes:(i + n) * row_bytes], 0
            while done < len(chunk):
                done += os.pwrite(self.fd, chunk[done:], first * row_bytes + done)
            i += n
        self._crc.clear()

    def close(self) -> None:
        for w in self._writes:
            w.result()
        self._writes = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.remove(self.path)
        except OSError:
            pass


ROW_GAP = 64  # rows this close are read in one span (read_rows)


def _spans(rows: list[int], gap: int) -> list[tuple[int, int, list[int]]]:
    """Sorted ``rows`` split where neighbours are more than ``gap`` apart: (first, last, members)."""
    spans, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] - rows[i - 1] > gap:
            spans.append((rows[start], rows[i - 1], rows[start:i]))
            start = i
    return spans


def with_device_writes_done(kept: HostTierTensor) -> None:
    """A host tier with an accelerator: its side-stream writes landed before the host copy is read or written."""
    if kept.tier.saves_memory:
        kept.tier.accel.synchronize()


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous() if t.device.type == "cpu" else t.detach().reshape(-1).to("cpu")


def _pwrite(fd: int, holder: list[torch.Tensor], offset: int) -> int:
    """Write ``holder``'s one tensor at ``offset``. The tensor comes in a list that this empties, so nothing
    holds the buffer once the write returns (the pool's work item keeps its arguments until a moment after
    the future completes, which kept a finished write's window buffer alive under load)."""
    host = holder.pop()
    view = host.view(torch.uint8).numpy().data
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)
    return integrity.crc32(host)


def keep(tier: Tier, t: torch.Tensor, max_writes: int = 4) -> HostTierTensor | FileTierTensor:
    """Move the 1-D tensor ``t`` to ``tier`` for good (the caller drops its own reference)."""
    if isinstance(tier, FileTier):
        return FileTierTensor(tier, t, max_writes)
    if isinstance(tier, HostTier):
        return HostTierTensor(tier, t)
    return tier.keep_tensor(t)  # type: ignore[attr-defined,no-any-return]  # the estimator's meta tier: its own kind
