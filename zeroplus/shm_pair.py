"""Two ranks on one host swap large buffers through a shared-memory mapping instead of gloo's TCP loopback.

At two gloo ranks, the data-parallel group's all-gather (each rank sends its chunk and receives the other's) and the
gradient exchange (``transports.PerRank.exchange``: each sends the other its row and receives its own) are both a
swap of equal byte counts, and a sum all-reduce or a reduce of two onto each rank is a swap whose received chunks
are added in place (``swap(add=True)``). Through loopback TCP each byte is copied into the kernel and out again by
gloo's threads, on the cores the ranks compute on; here it is written once into a slot of a mapping both processes
share and read once out of it. Measured on this 2-core CPU, an all-gather of 111 MB per rank: gloo's two broadcasts
70-107 ms, the swap 30-41 ms (design note below).

How: one file under /dev/shm (and two FIFOs beside it), made by rank 0, opened by both ranks and unlinked as soon as
both have them (nothing outlives the processes). It holds a header of counters and, per rank, ``SLOTS`` slots of
``SLOT_BYTES``. A swap of n bytes runs chunk by chunk: a rank writes chunk k into its slot k mod ``SLOTS`` once the
peer has read what was there, and reads the peer's chunk k once the peer has written it. Each counter (chunks
written, chunks read, gave up) has one writer and only grows. A rank's swaps run in the order issued, on one worker
thread (torch's copies release the GIL), so a swap progresses whatever the issuing thread does, as gloo's work does,
and ranks issuing the same collectives in the same order (as every collective requires) cannot deadlock on it. Every
chunk carries its swap's byte count, so ranks that swap different sizes raise instead of reading each other's bytes
wrongly. A rank that must wait blocks on a pipe the peer writes a byte to after each counter it raises (no core
spent polling: the first version polled with sleeps and cost the computing ranks more than gloo did), and looks
every 5 ms whether the peer gave up, its process is gone or the collective timeout passed: each raises in the
issuing thread as a gloo failure would (``collective_failed``).

x86-64 only: there stores become visible to other cores in program order, so a counter seen raised means the chunk
before it is there. Elsewhere (no fences from Python) the group keeps gloo.

Memory: the mapping, ``2 * SLOTS * SLOT_BYTES`` (4 MiB) plus a 4 KiB header, mapped whole by both ranks, every page
made resident when it opens (the resident set matches the ledger from the start) and counted once per rank in the
ledger (``Category.COMM_BUFFER``; the estimate's two-rank gloo group counts it alike), for the life of the group.
Nothing per swap.
See note: shared-memory pair (docs/design-notes.md).
"""
from __future__ import annotations

import logging
import mmap
import os
import platform
import queue
import select
import socket
import threading
import time
import uuid
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .ledger import Category, Ledger

SLOT_BYTES = 1 << 20
SLOTS = 2
MIN_BYTES = 256 << 10  # smaller messages stay on gloo (a swap's hand-offs cost more than its copies save)
HEADER_BYTES = 4096
MAPPING_BYTES = HEADER_BYTES + 2 * SLOTS * SLOT_BYTES
ENV_OFF = "ZEROPLUS_SHM_PAIR"  # "0": keep gloo (also config key 'zeroplus.shared_memory_pair': false)
_WRITTEN, _READ, _GAVE_UP, _SIZES = 0, 2, 4, 8  # header int64 offsets: [rank] each; sizes [8 + rank * SLOTS + slot]
_CHECK_SECONDS = 0.005  # how often a wait looks at the peer's state and the clock

logger = logging.getLogger("zeroplus.comm")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (an exited one its parent has not reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Swap:
    """One queued swap; ``wait()`` as a backend work's (a ``RuntimeError`` when it failed)."""

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, add: torch.dtype | None) -> None:
        self.send: torch.Tensor | None = send
        self.recv: torch.Tensor | None = recv
        self.add = add  # the dtype whose values are added into ``recv`` rather than copied (``swap(add=True)``)
        self.finished = threading.Event()
        self.error: str | None = None

    def wait(self) -> None:
        self.finished.wait()
        if self.error is not None:
            raise RuntimeError(self.error)


class SharedPair:
    """This rank's side of the mapping shared with the other rank of a two-rank group (``open_pair`` makes it)."""

    def __init__(self, mapped: mmap.mmap, wake: tuple[int, int], rank: int, peer_pid: int,
                 timeout: Callable[[], float]) -> None:
        """``wake``: this rank's pipe to wait on and the peer's to write to (file descriptors)."""
        self._mapped = mapped
        self._wake_in, self._wake_out = wake
        self._counters = np.frombuffer(mapped, dtype=np.int64, count=HEADER_BYTES // 8)
        raw = torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8))
        self.tensor = raw  # the whole mapping (for the ledger)
        slots = raw[HEADER_BYTES:].view(2, SLOTS, SLOT_BYTES)
        self.rank, self.peer, self.peer_pid = rank, 1 - rank, peer_pid
        self._mine, self._theirs = slots[rank], slots[1 - rank]
        self._mine.zero_()  # every page resident from the start, as the ledger counts it (the peer's: one read each)
        int(raw[::mmap.PAGESIZE].sum())
        self._timeout = timeout
        self._written = self._read = 0  # this rank's counts (the header shows them to the peer)
        self._jobs: queue.SimpleQueue[_Swap] = queue.SimpleQueue()
        self._broken: str | None = None
        self._worker = threading.Thread(target=self._run, name="zeroplus-shm-pair", daemon=True)
        self._worker.start()

    @property
    def chunks_sent(self) -> int:
        """How many slot-sized chunks this rank has written for the peer so far (what the pair has carried)."""
        return self._written

    def swap(self, send: torch.Tensor, recv: torch.Tensor, add: bool = False) -> _Swap:
        """Queue: ``send`` (contiguous) to the peer, the peer's bytes into ``recv`` (contiguous, as many bytes), or
        with ``add`` the peer's values added into ``recv`` (``recv`` may be ``send``: an all-reduce of two in place,
        each chunk sent before the peer's is added into it; else a reduce of two onto each rank). Mine + theirs on
        one rank, theirs + mine on the other: one value (two addends commute), gloo's sum of two to the bit. Its
        ``wait()`` returns once all is done; neither tensor may be touched before."""
        job = _Swap(send.reshape(-1).view(torch.uint8), recv.reshape(-1).view(torch.uint8),
                    recv.dtype if add else None)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if self._broken is not None:
                    raise RuntimeError(self._broken)
                self._do(job)
            except Exception as err:  # noqa: BLE001 - handed to the waiting thread
                if self._broken is None:
                    self._broken = f"shared-memory swap with rank {self.peer}: {err}"
                    self._counters[_GAVE_UP + self.rank] = 1
                    self._wake()
                job.error = self._broken
            finally:
                job.send = job.recv = None  # the issuing thread's aliases are then the only owners
                job.finished.set()

    def _do(self, job: _Swap) -> None:
        send, recv = job.send, job.recv
        assert send is not None and recv is not None
        n = send.numel()
        if recv.numel() != n:
            raise RuntimeError(f"sends {n} bytes but receives {recv.numel()}")
        c, me, peer = self._counters, self.rank, self.peer
        chunks = -(-n // SLOT_BYTES)
        for k in range(chunks + 1):
            if k < chunks:  # write chunk k once the peer has read what its slot held
                w = self._written
                self._until(_READ + peer, w - SLOTS + 1)
                a, b = k * SLOT_BYTES, min(n, (k + 1) * SLOT_BYTES)
                self._mine[w % SLOTS, :b - a].copy_(send[a:b])
                c[_SIZES + me * SLOTS + w % SLOTS] = n
                c[_WRITTEN + me] = self._written = w + 1
                self._wake()
            if k:  # read the peer's chunk k - 1 once it is written
                r = self._read
                self._until(_WRITTEN + peer, r + 1)
                theirs = int(c[_SIZES + peer * SLOTS + r % SLOTS])
                if theirs != n:
                    raise RuntimeError(f"the ranks swap different sizes: {n} bytes on rank {me}, {theirs} on rank "
                                       f"{peer} (their collectives differ)")
                a, b = (k - 1) * SLOT_BYTES, min(n, k * SLOT_BYTES)
                if job.add is None:
                    recv[a:b].copy_(self._theirs[r % SLOTS, :b - a])
                else:  # (chunk k - 1 of ``send`` went out in the last round: adding into it is safe)
                    recv[a:b].view(job.add).add_(self._theirs[r % SLOTS, :b - a].view(job.add))
                c[_READ + me] = self._read = r + 1
                self._wake()

    def _until(self, index: int, target: int) -> None:
        """Block until counter ``index`` reaches ``target`` (woken by the peer's byte on the pipe after each
        counter it raises): the peer giving up, its process gone or the collective timeout raise."""
        c = self._counters
        start = time.monotonic()
        while c[index] < target:
            ready, _, _ = select.select([self._wake_in], [], [], _CHECK_SECONDS)
            if ready:
                os.read(self._wake_in, 4096)  # drained before the counter is read again: no wake-up is lost
                continue
            if c[_GAVE_UP + self.peer]:
                raise RuntimeError(f"rank {self.peer} gave up on it (its own collective failed)")
            if not process_alive(self.peer_pid):
                raise RuntimeError(f"rank {self.peer}'s process (pid {self.peer_pid}) is gone")
            if time.monotonic() - start > self._timeout():
                raise RuntimeError(f"rank {self.peer} did not come within {self._timeout():g} s")

    def _wake(self) -> None:
        """Tell the peer a counter moved (a byte on its pipe; a full pipe already holds wake-ups enough)."""
        try:
            os.write(self._wake_out, b"x")
        except BlockingIOError:
            pass


def possible_here() -> bool:
    """This process could share a pair: x86-64, a /dev/shm, and ``ZEROPLUS_SHM_PAIR`` not 0."""
    return (platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")
            and os.environ.get(ENV_OFF, "1") != "0")


class _Agreeing(Protocol):
    """What opening a pair asks of its group (``comm.DataParallelGroup``): its rank and two object collectives."""

    rank: int

    def all_gather_objects(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any) -> Any: ...


def open_pair(dp: _Agreeing, ledger: Ledger, timeout: Callable[[], float]) -> SharedPair | None:
    """Collective over ``dp``: the two ranks' ``SharedPair`` when the group is two gloo ranks of one x86-64 host
    that can share a /dev/shm file, else None on both (and the group keeps gloo). The mapping goes into ``ledger``."""
    seen = dp.all_gather_objects((possible_here(), socket.gethostname(), _boot_id(), os.getpid()))
    if not all(s[0] for s in seen) or len({(s[1], s[2]) for s in seen}) != 1:
        return None
    path = f"/dev/shm/zeroplus-pair-{uuid.uuid4().hex}"
    opened: _Opened | None = None
    problem = None
    if dp.rank == 0:
        opened, problem = _open(path, dp.rank, create=True)
    path, problem0 = dp.broadcast_object((path, problem))
    if dp.rank == 1 and problem0 is None:
        opened, problem = _open(path, dp.rank, create=False)
    problems = [p for p in dp.all_gather_objects(problem) if p]
    if dp.rank == 0:
        for name in (path, f"{path}.to0", f"{path}.to1"):
            try:
                os.unlink(name)
            except OSError:
                pass
    if problems or opened is None:
        if opened is not None:
            opened.close()
        logger.warning("two ranks of one host keep gloo's loopback for large collectives: %s",
                       problems[0] if problems else "no mapping")
        return None
    pair = SharedPair(opened.mapped, (opened.wake_in, opened.wake_out), dp.rank, seen[1 - dp.rank][3], timeout)
    ledger.track(pair.tensor, Category.COMM_BUFFER)
    return pair


class _Opened:
    def __init__(self, mapped: mmap.mmap, wake_in: int, wake_out: int) -> None:
        self.mapped, self.wake_in, self.wake_out = mapped, wake_in, wake_out

    def close(self) -> None:
        self.mapped.close()
        os.close(self.wake_in)
        os.close(self.wake_out)


def _open(path: str, rank: int, create: bool) -> tuple[_Opened | None, str | None]:
    """The mapping and the two wake-up pipes (``path.to<rank>``: the one a rank waits on), made when ``create``."""
    fds: list[int] = []
    mapped = None
    try:
        if create:
            os.mkfifo(f"{path}.to0", 0o600)
            os.mkfifo(f"{path}.to1", 0o600)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        fds.append(fd)
        if create:
            os.ftruncate(fd, MAPPING_BYTES)
        mapped = mmap.mmap(fd, MAPPING_BYTES)
        os.close(fds.pop())
        # O_RDWR: a FIFO opened so neither waits for the other end; never at end of file
        wake_in = os.open(f"{path}.to{rank}", os.O_RDWR | os.O_NONBLOCK)
        fds.append(wake_in)
        wake_out = os.open(f"{path}.to{1 - rank}", os.O_RDWR | os.O_NONBLOCK)
        return _Opened(mapped, wake_in, wake_out), None
    except OSError as err:
        for fd in fds:
            os.close(fd)
        if mapped is not None:
            mapped.close()
        return None, f"{path}: {err}"


__all__ = ["SharedPair", "open_pair", "possible_here", "process_alive", "SLOT_BYTES", "SLOTS", "MIN_BYTES",
           "MAPPING_BYTES"]
