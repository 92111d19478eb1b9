"""What a training process holds beyond its tensors, measured on this machine once and kept.

The budget adds ``runtime`` to every phase: on CPU, resident memory that is not a tensor. Most of it is torch's own
code, paged in the first time a process trains (``first_use.py``); the rest is the engine's (its process group,
hooks, generated kernels, the first-forward estimate). It differs between machines, libraries and versions, so it is
not a constant: ``runtime_bytes("cpu")`` runs ``python -m zeroplus.runtime_probe`` in a child process (a three-step
run of a 0.3 MiB model), again with its first forward simulating twice, then in two that train as two ranks
(what a rank holds for its peer; about 35 s in all here), with glibc as zeroplus sets it by default
(``host_allocator.py``: no ``MALLOC_*`` variables of the caller's, as a user's process starts), and keeps its
numbers (from construction on, from the first backward on, how much of torch's code was resident after its model was
built, after ``initialize`` and after training, what a rank of two held more, what a step under the FLOPs profiler
added, what a second simulation at the first forward left, what full kernel caches hold: ``kernel_cache_bytes``, and
the code an fp8 optimizer step pages in: ``block_scaled_states_bytes``)
in a file keyed by host, Python, torch and zeroplus
versions and the probe's own version, so later processes on the machine read them. Ranks that start together wait on
one lock and probe once. ``initialize`` reads how much of torch's code its own process already holds, and the
prediction takes off what that process has paid already (a test session, a script that evaluated first, the
Trainer): no figure from a fresh process is added to one that has paid it. ``zeroplus estimate`` and the planner
before a launch assume a fresh process. On CUDA and NPU the budget predicts the caching allocator's peak, which
holds tensors only: 0.

Modules torch imports lazily are paid before the model exists, not predicted (see note: runtime
baseline). torch imports ``torch._dynamo`` (71 MiB resident here) when the first optimizer is built, so
a process that had imported it before building its model (every script that imports anything
concrete from Transformers) held it in its baseline, and one that had not paid it inside the engine:
the same run was predicted 71 MiB apart depending on the script's imports. zeroplus imports
``LAZY_IMPORTS`` with this module, so with ``import zeroplus``: they are in every baseline, in the
probe's too, and never in the prediction.

``ZEROPLUS_RUNTIME_BYTES="construction,training"`` (bytes, or sizes such as ``80MiB``) sets the two
numbers instead (whatever the process holds); ``ZEROPLUS_CACHE_DIR`` moves the file (default
``$XDG_CACHE_HOME/zeroplus`` or ``~/.cache/zeroplus``). If the probe cannot run, the budget warns with
its error and uses ``FALLBACK_BYTES``, measured on the machine that wrote this. Memory: nine integers;
the probe's memory is the child's.
See note: runtime overhead (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - LAZY_IMPORTS: into the process's baseline (see note: runtime baseline)

from ..cache_dir import cache_file, read_record, write_record
from ..config import parse_bytes
from ..host_allocator import ALLOCATOR_VARIABLES, THRESHOLD
from ..host_allocator import ENV as HOST_ALLOCATOR_ENV
from ..host_kernel_cache import IDEEP_ENV, ONEDNN_ENV, held_bytes

logger = logging.getLogger("zeroplus")

ENV = "ZEROPLUS_RUNTIME_BYTES"
# what zeroplus's default sets (host_allocator.py), as variables: for launching a process returning freed memory from
# its start
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD)}
# the probe's numbers; "peers": what a rank of two held beyond a rank alone from the first backward on (gloo's
# buffers for its peer, the collectives' code); "profiled", "profiled_with_peer": what a step under the FLOPs profiler
# put on the peak beyond that, in a rank alone and in a rank of two (Python dispatch around the collectives);
# "second_simulation": what one more simulation of the first forward's estimate left resident (an engine whose resize
# recompute was left unset simulates the run twice where it may pay; the probe's own engine, once);
# "block_scaled_states": torch's code a step over fp8 or mxfp8 moments pages in beyond training's
RECORD = ("construction", "training", "code_built", "code_constructed", "code_trained", "peers", "profiled",
          "profiled_with_peer", "second_simulation", "kernel_cache", "block_scaled_states")
# GPT-tiny, fp32, a 2-core machine: one gloo rank; peers from two; no kernel cache (fp32's products keep none)
FALLBACK_BYTES = (12 * 2**20, 24 * 2**20, 40 * 2**20, 45 * 2**20, 62 * 2**20, 2 * 2**20, 2**19, 3 * 2**19, 2**16, 0,
                  3 * 2**20)
LAZY_IMPORTS = ("torch._dynamo",)  # what torch imports lazily for an engine: imported above, with zeroplus
DTYPES = ("fp32", "bf16", "fp16")  # compute dtypes, each probed apart
# what the probe measures changed (2: the step's norm scratch no longer counted whole in the tensors
# subtracted; measured on the engine report's basis; 3: torch's code resident recorded; 4: initialize no longer
# runs a meta forward of its own, so construction holds less; 5: glibc returns freed memory from import on and
# initialize starts from a trimmed heap; 6: its engine predicts with an overhead, so it decides resize recompute as a
# user's process does; 7: its step keeps the clip coefficient and overflow flag on the device, whose kernels'
# code it pages in; 8: resize recompute's default found by what modules compute; 9: the first forward's prediction
# frees the reference cycles its simulation left, which the probe's peak held until the collector ran; 10: a
# two-rank run measures what a rank holds for its peer, where a constant stood; 11: a third step under the FLOPs
# profiler; 12: its engine simulates once where resize recompute cannot pay, and one more simulation's residue is
# measured; 13: glibc's thresholds at 32 KiB, not 128; 14: what full kernel caches hold, measured; 15: its training
# figure without MKL's buffer pool, which a run's own prediction measures for its shapes; 16: torch's flight recorder
# off in its ranks, as zeroplus sets it on CPU; 17: the code an fp8 and an mxfp8 optimizer step page in; 18: MKL's
# pool taken off as the resident bytes it gives back, not MKL's count of its buffers): a kept result
# from an earlier meaning is probed again, whatever the package version
PROBE_VERSION = "18"
# a launcher's variables would make the probe's engine join the caller's job
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def runtime_bytes(kind: str, dtype: str = "fp32", code: int | None = None, world_size: int = 1,
                  profiled: bool = False) -> tuple[int, int]:
    """(bytes from the engine's construction on, bytes from the end of the first backward on) for a
    process training on accelerator ``kind`` in compute dtype ``dtype`` (``fp32``, ``bf16``, ``fp16``:
    a 16-bit run loads its own kernels, 11 MiB more for bf16 here; each is probed once).
    ``code``: ``first_use.code_resident()`` of the process the prediction is for, read when it starts
    ``initialize``; what it holds beyond the probe's after-build figure is taken off, up to what the
    probe's run paged in by then. None: a fresh process (nothing taken off). ``world_size`` above 1 on CPU:
    the probe's ``peers`` more from the first backward on (what a rank of two held beyond a rank alone).
    ``profiled``: the run profiles a step (``flops_profiler``): what the probe's profiled step added, in a rank
    of ``world_size`` (alone or with a peer), more from the first backward on."""
    if dtype not in DTYPES:
        raise ValueError(f"runtime_bytes: dtype {dtype!r} is not one of {DTYPES}")
    if kind != "cpu":
        return (0, 0)
    override = os.environ.get(ENV)
    if override is not None:
        return _parse_override(override)
    construction, training, built, constructed, trained, peers, alone, paired = _measured(dtype)[:8]
    peers = (peers + (paired if profiled else 0)) if world_size > 1 else (alone if profiled else 0)
    if code is None:
        return (construction, training + peers)
    ahead = max(0, code - built)
    return (max(0, construction - min(ahead, constructed - built)),
            max(0, training - min(ahead, trained - built)) + peers)


def second_simulation_bytes(kind: str, dtype: str = "fp32") -> int:
    """What a second simulation at the first forward leaves resident on accelerator ``kind`` (the probe's
    ``second_simulation``; 0 on CUDA and NPU, and where ``ZEROPLUS_RUNTIME_BYTES`` gives the overhead by hand)."""
    if kind != "cpu" or os.environ.get(ENV) is not None:
        return 0
    return _measured(dtype)[8]


def kernel_cache_bytes(kind: str, dtype: str = "fp32") -> int:
    """What the matrix-product kernel caches hold once a model whose product shapes change every step (routed
    experts) has filled them, on accelerator ``kind`` in compute dtype ``dtype``: the probe's ``kernel_cache``
    at the capacity in force (``host_kernel_cache.held_bytes``); 0 on CUDA and NPU, and where
    ``ZEROPLUS_RUNTIME_BYTES`` gives the overhead by hand."""
    if kind != "cpu" or os.environ.get(ENV) is not None:
        return 0
    return held_bytes(_measured(dtype)[9])


def block_scaled_states_bytes(kind: str, dtype: str = "fp32") -> int:
    """What a run whose optimizer moments are fp8 or mxfp8 holds more from its first step on, on accelerator
    ``kind``: torch's code for their conversions and scales (the probe's ``block_scaled_states``); 0 on CUDA and NPU,
    and where ``ZEROPLUS_RUNTIME_BYTES`` gives the overhead by hand."""
    if kind != "cpu" or os.environ.get(ENV) is not None:
        return 0
    return _measured(dtype)[10]


@functools.lru_cache(maxsize=None)
def _measured(dtype: str) -> tuple[int, ...]:
    """The probe's numbers (``RECORD`` order), from the kept file or probed now."""
    path = _cache_file(dtype)
    cached = _read(path)
    if cached is not None:
        return cached
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(path + ".lock", "w")  # noqa: SIM115 - held across the probe, closed below
    except OSError as err:
        logger.warning("cannot keep the runtime overhead in %s (%s): measuring it for this process only", path, err)
        return probe(dtype)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        cached = _read(path)  # a rank that waited finds the first one's result
        if cached is not None:
            return cached
        measured = probe(dtype)
        _write(path, measured, dtype)
        return measured


def probe(dtype: str = "fp32") -> tuple[int, ...]:
    """Run ``zeroplus.runtime_probe`` in a child process, again with its first forward simulating twice (what
    that adds is ``second_simulation``: 0.06 MiB here on 2026-12-03, inside the spread of ``training`` from one run
    to the next, about 0.3 MiB), then as two ranks of two processes, and return the one rank's numbers with ``peers``
    (``RECORD`` order); on failure, warn and return ``FALLBACK_BYTES``."""
    # (the kernel caches as zeroplus bounds them: what kernel_cache is of)
    own = {HOST_ALLOCATOR_ENV, ONEDNN_ENV, IDEEP_ENV, *ALLOCATOR_VARIABLES, *_LAUNCH_ENV}
    env = {k: v for k, v in os.environ.items() if k not in own}
    # the fallback, not 0: the engine inside decides what a user's decides (a budget of tensors alone finds resize
    # recompute pays on the probe's model, one simulation; with the overhead it stands down after a second, which
    # leaves 1.4 MiB resident); what the probe reports is its measure minus the tensors, whatever this adds
    env.update(ZEROPLUS_ACCELERATOR="cpu", **{ENV: f"{FALLBACK_BYTES[0]},{FALLBACK_BYTES[1]}"})
    cmd = [sys.executable, "-m", "zeroplus.runtime_probe", "--dtype", dtype]
    try:
        (alone,) = _run_probe([*cmd, "--kernel-cache"], env, 1)
        (twice,) = _run_probe([*cmd, "--simulations", "2"], env, 1)
        alone["second_simulation"] = max(0, int(twice["training"]) - int(alone["training"]))
        pair = _run_probe(cmd, env, 2)
        paired = max(int(r["training"]) for r in pair)
        alone["peers"] = max(0, paired - int(alone["training"]))
        alone["profiled_with_peer"] = max(0, max(int(r["training"]) + int(r["profiled"]) for r in pair) - paired)
        measured = _record(alone)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, subprocess.TimeoutExpired) as err:
        logger.warning("the runtime overhead probe (%s) failed (%s: %s); the memory budget uses %s instead "
                       "(set %s to give it)", " ".join(cmd), type(err).__name__, err, _describe(FALLBACK_BYTES), ENV)
        return FALLBACK_BYTES
    logger.info("runtime overhead measured on this machine: %s", _describe(measured))
    return measured


def _run_probe(cmd: list[str], env: dict[str, str], world_size: int) -> list[dict[str, Any]]:
    """The probe's JSON from each of ``world_size`` processes run together (they meet at a file store in a
    temporary directory); RuntimeError naming the rank and its error if one fails."""
    with tempfile.TemporaryDirectory(prefix="zeroplus-probe-") as tmp:
        ranks = [] if world_size == 1 else ["--world-size", str(world_size), "--store", os.path.join(tmp, "store")]
        procs = [subprocess.Popen([*cmd, *ranks, *(["--rank", str(r)] if ranks else [])], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world_size)]
        try:
            outputs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            raise RuntimeError(f"rank {rank} of {world_size}: exit code {p.returncode}: {err.strip()[-500:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _parse_override(value: str) -> tuple[int, int]:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2:
        raise ValueError(f"environment variable {ENV} is {value!r}: give two sizes, 'construction,training' "
                         f"(e.g. '80MiB,100MiB')")
    first, second = (parse_bytes(p, what=f"environment variable {ENV}") for p in parts)
    return (first, second)


def _describe(measured: tuple[int, ...]) -> str:
    return (f"{measured[0] / 2**20:.1f} MiB from construction, {measured[1] / 2**20:.1f} MiB from the first "
            f"backward, {(measured[4] - measured[2]) / 2**20:.1f} MiB of it torch's code paged in, "
            f"{measured[5] / 2**20:.1f} MiB more with a peer; a step under the FLOPs profiler "
            f"{measured[6] / 2**20:.1f} MiB more, {measured[7] / 2**20:.1f} with a peer; a second simulation "
            f"{measured[8] / 2**20:.1f} MiB; full kernel caches {measured[9] / 2**20:.1f} MiB; fp8 optimizer moments' "
            f"code {measured[10] / 2**20:.1f} MiB")


def _cache_key(dtype: str) -> dict[str, str]:
    return {"dtype": dtype, "host": platform.node(), "machine": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "zeroplus": _zeroplus_version(), "baseline": ",".join(LAZY_IMPORTS),
            "probe": PROBE_VERSION}


def _zeroplus_version() -> str:
    try:
        return importlib.metadata.version("zeroplus")
    except importlib.metadata.PackageNotFoundError:
        return "source"


def _cache_file(dtype: str) -> str:
    return cache_file("runtime-overhead", _cache_key(dtype))


def _record(values: dict[str, Any]) -> tuple[int, ...]:
    """The probe's numbers from its JSON or the kept file, in ``RECORD`` order (KeyError, TypeError or
    ValueError when one is missing or not a number)."""
    return tuple(int(values[key]) for key in RECORD)


def _read(path: str) -> tuple[int, ...] | None:
    record = read_record(path)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return _record(record) if record is not None else None
    return None


def _write(path: str, measured: tuple[int, ...], dtype: str) -> None:
    write_record(path, {**dict(zip(RECORD, measured)), **_cache_key(dtype)})
