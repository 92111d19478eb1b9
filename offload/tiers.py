"""Memory tiers below the device: host memory and files, with asynchronous moves.

A tier stores a tensor (``put``), starts bringing it back (``prefetch``) and hands it back on
the device (``get``); ``put`` returns at once and the device copy can be dropped by the caller
as soon as it has no other use.

- ``HostTier``: on CUDA/NPU, a pinned host buffer filled on a side stream (the device tensor is
  recorded on that stream, so the allocator reuses it only after the copy) and copied back on
  another side stream, which the compute stream waits for in ``get``. On a CPU-only machine the
  host *is* the device: ``put`` keeps the tensor as it is and saves nothing (the engine says so
  once in the log).
- ``FileTier``: one file per stored tensor, in a per-process directory
  ``<path>/zeroplus-swap-<pid>[-<label>]`` written and read by two thread pools (reads never
  wait behind writes); on accelerators the bytes pass through host memory first. This is the
  tier that saves memory on a CPU-only machine. The directory is removed at normal exit;
  directories left by dead processes are removed when the next ``FileTier`` starts in the same
  path.

Every file write records a CRC-32 that the read returning it checks (``integrity.py``).

Memory: ``HostTier`` holds each stored tensor in host memory (``offload_buffer`` in the ledger
when the host is not the device); ``FileTier`` holds a tensor in memory only until its write
finishes, and a prefetched one from the start of its read until its consumer drops it. Every
buffer a tier brings back is counted in the ledger's ``offload_buffer`` from its allocation, so a
prefetch window shows there while it is in flight, not only once it is taken.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from zeroplus.accelerator import Accelerator
from zeroplus.ledger import Category, Ledger
from zeroplus.shm_pair import process_alive

from . import direct_io, integrity

logger = logging.getLogger("zeroplus.offload")

_SWAP_PREFIX = "zeroplus-swap-"


class Stored:
    """A tensor living on a tier: how to rebuild it, and the tier's handle on the bytes."""

    __slots__ = ("shape", "dtype", "device", "nbytes", "data", "ready", "back")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()
        self.data: Any = None   # host tensor, or file path
        self.ready: Any = None  # event or future: the move out is done
        self.back: Any = None   # the prefetch in flight: (tensor, event) or a future


class Tier(Protocol):
    """What the mechanisms above ask of a tier: ``HostTier``, ``FileTier`` and the estimator's ``MetaTier``
    (``meta_tier.py``) provide it (see the module docstring for each one's memory)."""

    @property
    def name(self) -> str: ...

    @property
    def saves_memory(self) -> bool: ...

    @property
    def directory(self) -> str | None: ...

    @property
    def ledger(self) -> Ledger: ...

    def put(self, t: torch.Tensor) -> Stored: ...

    def prefetch(self, stored: Stored) -> None: ...

    def get(self, stored: Stored) -> torch.Tensor: ...

    def wait_written(self, stored: Stored) -> None: ...

    def discard(self, stored: Stored) -> None: ...


class HostTier:
    name = "host"
    directory: str | None = None  # (a file tier's folder; host memory has none)

    def __init__(self, accelerator: Accelerator, ledger: Ledger) -> None:
        self.accel = accelerator
        self.ledger = ledger
        self.saves_memory = not accelerator.host_is_device
        self._out_stream = accelerator.new_stream()
        self._in_stream = accelerator.new_stream()

    def _in_place(self, device: torch.device) -> bool:
        """A tensor on ``device`` stays as it is: nothing to move (no accelerator, or already in host memory)."""
        return not self.saves_memory or device.type == "cpu"

    def put(self, t: torch.Tensor) -> Stored:
        stored = Stored(t)
        if self._in_place(t.device):
            stored.data = t
            return stored
        host = self.accel.pin_memory(torch.empty(t.shape, dtype=t.dtype))
        self.ledger.track(host, Category.OFFLOAD_BUFFER)
        self._out_stream.wait_stream(self.accel.current_stream())
        with self.accel.stream(self._out_stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(self._out_stream)
            stored.ready = self.accel.new_event()
            stored.ready.record(self._out_stream)
        stored.data = host
        return stored

    def prefetch(self, stored: Stored) -> None:
        if self._in_place(stored.device) or stored.back is not None:
            return
        self._in_stream.wait_event(stored.ready)
        with self.accel.stream(self._in_stream):
            back = self.ledger.track(stored.data.to(stored.device, non_blocking=True), Category.OFFLOAD_BUFFER)
            event = self.accel.new_event()
            event.record(self._in_stream)
        stored.back = (back, event)

    def get(self, stored: Stored) -> torch.Tensor:
        if self._in_place(stored.device):
            return stored.data
        self.prefetch(stored)
        back, event = stored.back
        event.wait(self.accel.current_stream())
        back.record_stream(self.accel.current_stream())
        stored.back, stored.data = None, None
        return back

    def discard(self, stored: Stored) -> None:
        stored.back, stored.data = None, None

    def wait_written(self, stored: Stored) -> None:
        """Block until ``put``'s copy out is done (so the device tensor it read can be reused)."""
        if stored.ready is not None:
            begun = time.perf_counter()
            stored.ready.synchronize()
            self.ledger.waited(time.perf_counter() - begun)


class FileTier:
    name = "file"

    def __init__(self, path: str, ledger: Ledger, workers: int = 2, label: str = "", direct: bool = False,
                 create: bool = True) -> None:
        """``label`` tells apart the directories of several tiers of one process in one path;
        ``direct``: tensors of at least ``direct_io.MIN_BYTES`` go through ``O_DIRECT`` files where
        the filesystem accepts them (``direct_io.py``); ``create``: make ``path`` if it is missing
        (offload paths are not made: a mistyped mount point would silently fill another disk)."""
        self.ledger = ledger
        self.saves_memory = True
        if not create and not os.path.isdir(path):
            raise ValueError(f"directory {path!r} does not exist (zeroplus does not create offload directories, so a "
                             f"mistyped mount point cannot fill another disk)")
        try:
            os.makedirs(path, exist_ok=True)
            _remove_dead_directories(path)
            self.directory = os.path.join(path, f"{_SWAP_PREFIX}{os.getpid()}" + (f"-{label}" if label else ""))
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, ".probe")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as err:
            raise ValueError(f"swap directory {path!r} is not usable: {err}") from None
        self.direct = direct and direct_io.probe(self.directory)
        if direct and not self.direct:
            logger.info("%s does not accept O_DIRECT files; the file tier uses the page cache there", path)
        # Reads and writes on separate threads: a prefetch never queues behind write-backs.
        self.read_pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="zeroplus-read")
        self.write_pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="zeroplus-write")
        self._names = itertools.count()
        atexit.register(self.close)

    def put(self, t: torch.Tensor) -> Stored:
        stored = Stored(t)
        stored.data = os.path.join(self.directory, f"{next(self._names)}.bin")
        host = t.detach().contiguous() if t.device.type == "cpu" else t.detach().to("cpu")
        if self._is_direct(stored):
            stored.ready = self.write_pool.submit(_direct_write, stored.data, [host], self.ledger)
        else:
            stored.ready = self.write_pool.submit(_write, stored.data, [host])
        return stored

    def _is_direct(self, stored: Stored) -> bool:
        return self.direct and stored.nbytes >= direct_io.MIN_BYTES

    def prefetch(self, stored: Stored) -> None:
        if stored.back is None:
            stored.back = self.read_pool.submit(self._read, stored)

    def _read(self, stored: Stored) -> torch.Tensor:
        written_crc = stored.ready.result()
        if self._is_direct(stored):
            buf = direct_io.read(stored.data, stored.nbytes, self.ledger)
        else:
            buf = self.ledger.empty(stored.nbytes, torch.uint8, Category.OFFLOAD_BUFFER)
            with open(stored.data, "rb") as f:
                if f.readinto(buf.numpy().data) != stored.nbytes:
                    raise OSError(f"swap file {stored.data} is shorter than the {stored.nbytes} bytes written")
        integrity.verify(stored.data, buf, written_crc)
        os.remove(stored.data)
        return buf.view(stored.dtype).view(stored.shape)

    def get(self, stored: Stored) -> torch.Tensor:
        self.prefetch(stored)
        begun = time.perf_counter()
        value = stored.back.result()
        self.ledger.waited(time.perf_counter() - begun)
        stored.back = None
        if stored.device.type == "cpu":
            return value
        return self.ledger.track(value.to(stored.device), Category.OFFLOAD_BUFFER)

    def wait_written(self, stored: Stored) -> None:
        begun = time.perf_counter()
        stored.ready.result()
        self.ledger.waited(time.perf_counter() - begun)

    def discard(self, stored: Stored) -> None:
        with contextlib.suppress(Exception):
            stored.ready.result()
        with contextlib.suppress(OSError):
            os.remove(stored.data)

    def close(self) -> None:
        self.read_pool.shutdown(wait=True)
        self.write_pool.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def _write(path: str, holder: list[torch.Tensor]) -> int:
    """Write ``holder``'s one tensor to ``path``, emptying ``holder`` (see ``tier_tensor._pwrite``); its CRC-32."""
    host = holder.pop()
    with open(path, "wb") as f:
        f.write(host.reshape(-1).view(torch.uint8).numpy().data)
    return integrity.crc32(host)


def _direct_write(path: str, holder: list[torch.Tensor], ledger: Ledger) -> int:
    host = holder.pop()
    direct_io.write(path, host, ledger)
    return integrity.crc32(host)


def _remove_dead_directories(path: str) -> None:
    """Swap directories of processes that no longer run (a crash) are removed."""
    for entry in os.listdir(path):
        if not entry.startswith(_SWAP_PREFIX):
            continue
        pid = entry[len(_SWAP_PREFIX):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            logger.info("removing swap directory %s left by process %s", os.path.join(path, entry), pid)
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def make_tier(kind: str, path: str | None, accelerator: Accelerator, ledger: Ledger,
              label: str = "", direct: bool = False, create: bool = True) -> HostTier | FileTier:
    simulated = getattr(accelerator, "simulated_tier", None)  # the estimator's accelerator brings its own tier
    if simulated is not None and (kind == "file" or not accelerator.host_is_device):
        return simulated(ledger, direct and kind == "file")  # type: ignore[no-any-return]
    if kind == "file":
        if not path:
            raise ValueError("a file tier needs a directory path, and none is set")
        return FileTier(path, ledger, label=label, direct=direct, create=create)
    return HostTier(accelerator, ledger)


if TYPE_CHECKING:  # mypy proves both tiers provide the interface
    _host: type[Tier] = HostTier
    _file: type[Tier] = FileTier
