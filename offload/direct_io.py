"""Direct I/O for the file tier: ``O_DIRECT`` files through page-aligned buffers, bypassing the page cache.

Buffered files leave every byte written in the kernel's page cache, so a run that offloads tens
of GB to NVMe also fills host RAM with cached copies (reclaimable, but it competes with pinned
buffers and other processes). With ``O_DIRECT`` the bytes go straight between the buffer and the
device. The kernel then requires the buffer address, the file offset and the length to be
multiples of the block size: ``ALIGN`` (4 KiB) covers every common device.

``aligned_empty`` allocates ``nbytes`` rounded up to ``ALIGN`` at an aligned address (through the
ledger, ``offload_buffer``: one extra ``ALIGN`` of slack). A write copies the tensor into such a
staging buffer first (one more copy of that tensor while the write runs; the staging buffer is
freed after it); a read lands in one and the tensor handed back is a view of it (no extra copy).
Files hold the padded length. ``probe`` tells whether a directory's filesystem accepts
``O_DIRECT`` (tmpfs and some overlay filesystems do not); where it does not, the tier stays
buffered.
See note: direct io (docs/design-notes.md).
"""
from __future__ import annotations

import os

import torch

from zeroplus.ledger import Category, Ledger

ALIGN = 4096
MIN_BYTES = 1 << 16  # smaller tensors stay buffered: alignment padding would dominate


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, ledger: Ledger, device: str = "cpu") -> torch.Tensor:
    """``padded(nbytes)`` bytes (uint8) at an ``ALIGN``-aligned address (``device`` "meta": the
    estimator's stand-in, same size)."""
    raw = ledger.empty(padded(nbytes) + ALIGN, torch.uint8, Category.OFFLOAD_BUFFER, device)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + padded(nbytes)]


def probe(directory: str) -> bool:
    """Does ``directory`` accept an aligned ``O_DIRECT`` write and read?"""
    path = os.path.join(directory, ".direct-probe")
    buf = aligned_empty(ALIGN, Ledger())
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            view = buf.numpy().data
            return os.pwrite(fd, view, 0) == ALIGN and os.preadv(fd, [view], 0) == ALIGN
        finally:
            os.close(fd)
    except (OSError, AttributeError):  # AttributeError: no os.O_DIRECT on this platform
        return False
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


def write(path: str, host: torch.Tensor, ledger: Ledger) -> None:
    """Write the CPU tensor ``host`` to a new file at ``path``, padded to ``ALIGN``."""
    flat = host.reshape(-1).view(torch.uint8)
    staging = aligned_empty(flat.numel(), ledger)
    staging[:flat.numel()].copy_(flat)
    staging[flat.numel():].zero_()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        view = staging.numpy().data
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], done)
    finally:
        os.close(fd)


def read(path: str, nbytes: int, ledger: Ledger) -> torch.Tensor:
    """The first ``nbytes`` of the file at ``path`` (written by ``write``), as a uint8 view of an aligned buffer."""
    buf = aligned_empty(nbytes, ledger)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.preadv(fd, [buf.numpy().data], 0)
    finally:
        os.close(fd)
    if got < nbytes:
        raise OSError(f"swap file {path} is shorter than the {nbytes} bytes written")
    return buf[:nbytes]
