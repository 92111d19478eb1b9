"""Integrity of offload and swap files: a CRC-32 of every write, checked on the read that returns it.

A swap or offload file that changed on disk (zero-filled, truncated, overwritten by another process, a
failing disk) would otherwise be read back as training state without a word. Each write computes the
CRC-32 of its bytes in the writer thread (zlib, about 2.5 GB/s on one core here, the GIL released), and
the read that returns the same range compares it: a mismatch is an ``OSError`` naming the file and the
range. Costs 4 bytes per write kept, no copies.
"""
from __future__ import annotations

import errno
import zlib

import torch
import torch.distributed as dist


def crc32(host: torch.Tensor) -> int:
    """The CRC-32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(host.reshape(-1).view(torch.uint8).numpy().data)


def verify(path: str, host: torch.Tensor, expected: int, where: str = "") -> None:
    """Raise naming ``path`` unless ``host`` (just read from it) has the CRC-32 that was written."""
    got = crc32(host)
    if got != expected:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        raise OSError(errno.EIO, f"offload file {path}{where} is corrupt on rank {rank}: CRC-32 {got:08x} of what was "
                                 f"read, {expected:08x} written (the file was changed on disk, or the disk returned "
                                 f"other bytes)")
