"""Run a function on N gloo ranks on CPU, each a fresh process.

``run_distributed(fn, world_size, *args)`` returns ``[fn(*args) on rank 0, ..., rank N-1]``.
A free port per call; a timeout per call; a rank's exception is re-raised in the test with the
rank and its traceback. ``fn`` must be importable (defined at module level).

The ranks are forked from a fork server that imported torch, zeroplus and Transformers once
(``FORKSERVER_PRELOAD``), instead of each starting Python and importing them again: 3.3 s for
two ranks of nothing spawned, against a fraction of a second forked. Each rank is still a new
process with no process group; it takes the test's environment variables and working directory
as they are at the call. Variables read only when a process starts (the allocator's ``MALLOC_*``,
``LD_*``, ``PYTHON*``, OpenMP's) cannot reach a forked rank: when the test changed one of those, its
ranks are spawned instead, as before.
See note: fork server (docs/design-notes.md).
"""
from __future__ import annotations

import datetime
import io
import os
import queue
import random
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size; (0, 1) when no process group exists (in-process runs)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def rank0_value(make: Callable[[], Any]) -> Any:
    """``make()`` on rank 0, given to every rank (``make`` itself where no process group exists): for a figure a
    rank measures in its own process, as a budget from ``zeroplus.estimate``, that a test holds every rank to."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_PORTS = (10000, 30000)  # a band a test's store listens in, kept below the ephemeral range when the host allows


def free_port() -> int:
    """A port nothing listens on, outside the range the kernel hands out for outgoing connections.

    Asking the kernel for a free port (bind to 0) returns one from its ephemeral range; between that
    check and the store's listen, a gloo connection of a rank of another test (another xdist worker)
    can be given the same port as its local end, and the store fails with EADDRINUSE (seen once in a
    full suite). Ports outside that range are never given to a connection; each xdist worker draws from
    its own residue class, so two workers never pick the same one.
    """
    low, high = _PORTS
    eph_low, eph_high = _ephemeral_range()
    if not (high <= eph_low or low > eph_high):
        low, high = (1024, eph_low) if eph_low - 1024 >= 2000 else (eph_high + 1, 65536)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    tries = 200 if high - low >= 2 * workers else 0  # (no band outside the range: the kernel's choice below)
    for _ in range(tries):
        port = rng.randrange(low, high)
        port -= (port - index) % workers
        if port < low:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the band is full: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FORKSERVER_PRELOAD = ["torch", "torch.distributed", "zeroplus", "tests.dist_helper", "transformers"]
_STARTUP_PREFIXES = ("MALLOC_", "GLIBC_", "LD_", "PYTHON", "OMP_", "KMP_", "MKL_")
_FORKSERVER = mp.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(FORKSERVER_PRELOAD)
_AT_IMPORT = {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_PREFIXES)}


def _context() -> Any:
    """The fork server, unless the test changed a variable only a new process reads (then: spawn)."""
    now = {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_PREFIXES)}
    return _FORKSERVER if now == _AT_IMPORT else mp.get_context("spawn")


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any,
            init: bool, environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), ZEROPLUS_ACCELERATOR="cpu",
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if init:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=180))
    try:
        value = fn(*args)
        buf = io.BytesIO()
        torch.save(value, buf)  # bytes, not shared-memory tensors: this process exits right after
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                    init: bool = True) -> list[Any]:
    """``init=False``: the launcher's environment only, as torchrun leaves it (zeroplus creates the group)."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environment = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, init, environment),
                         daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size and not errors:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    errors.append(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout}s waiting for a rank (got ranks {sorted(outputs)})")
                continue
            if ok:
                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [outputs[r] for r in range(world_size)]
