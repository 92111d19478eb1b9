"""What a training process holds beyond its tensors, measured on this machine once and kept.

The budget adds ``runtime`` to every phase: on CPU, resident memory that is not a tensor. Most of it
is paid once per process, by the first training step it ever runs (kernel code and generated
kernels, autograd's thread, the meta kernels of the estimate: ``first_use.py``), and the rest by
the engine itself (its process group, hooks, the first-forward estimate). The first part is
measured in the process the prediction is for: ``initialize`` runs ``first_use.pay`` and the
engine's prediction adds what it measured (all of it in a fresh process, nearly nothing in one
that has trained before: a test session, a script that evaluated its model first). The second part
differs between machines, libraries and versions, so it is not a constant either:
``runtime_bytes("cpu")`` runs ``python -m zeroplus.runtime_probe`` in a child process (a two-step run
of a 0.3 MiB model, about 8 s here), under the allocator the budget assumes (``ALLOCATOR_ENV``),
which measures first use apart and then the engine's two numbers (from construction on, from the
first backward on), and keeps the three in a file keyed by host, Python, torch and zeroplus versions
and the probe's own version, so later processes on the machine read them. Ranks that start together
wait on one lock and probe once. A prediction made outside the training process (``zeroplus
estimate``, the planner before a launch) adds the probe's first use: a fresh process's. On CUDA and
NPU the budget predicts the caching allocator's peak, which holds tensors only: 0.

Modules torch imports lazily are paid before the model exists, not predicted (see note: runtime
baseline). torch imports ``torch._dynamo`` (71 MiB resident here) when the first optimizer is built, so
a process that had imported it before building its model (every script that imports anything
concrete from Transformers) held it in its baseline, and one that had not paid it inside the engine:
the same run was predicted 71 MiB apart depending on the script's imports. zeroplus imports
``LAZY_IMPORTS`` with this module, so with ``import zeroplus``: they are in every baseline, in the
probe's too, and never in the prediction.

``ZEROPLUS_RUNTIME_BYTES="construction,training"`` (bytes, or sizes such as ``80MiB``) sets the two
totals instead (first use included); ``ZEROPLUS_CACHE_DIR`` moves the file (default
``$XDG_CACHE_HOME/zeroplus`` or ``~/.cache/zeroplus``). If the probe cannot run, the budget warns with
its error and uses ``FALLBACK_BYTES``, measured on the machine that wrote this. Memory: three integers;
the probe's memory is the child's.
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

import torch
import torch._dynamo  # noqa: F401 - LAZY_IMPORTS: into the process's baseline (see note: runtime baseline)

from ..cache_dir import cache_file, read_record, write_record
from ..config import parse_bytes

logger = logging.getLogger("zeroplus")

ENV = "ZEROPLUS_RUNTIME_BYTES"
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
# first use, then GPT-tiny on 1 gloo rank; fp32 on a 2-core x86 with avx512_bf16
FALLBACK_BYTES = (21 * 2**20, 2 * 2**20, 7 * 2**20)
LAZY_IMPORTS = ("torch._dynamo",)  # what torch imports lazily for an engine: imported above, with zeroplus
DTYPES = ("fp32", "bf16", "fp16")  # compute dtypes, each probed apart
# what the probe measures changed (2: the step's norm scratch no longer counted whole in the tensors
# subtracted; measured on the engine report's basis; 3: first use measured apart): a kept result from
# an earlier meaning is probed again, whatever the package version
PROBE_VERSION = "3"
# a launcher's variables would make the probe's engine join the caller's job
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def runtime_bytes(kind: str, dtype: str = "fp32", first_use: int | None = None) -> tuple[int, int]:
    """(bytes from the engine's construction on, bytes from the end of the first backward on) for a
    process training on accelerator ``kind`` in compute dtype ``dtype`` (``fp32``, ``bf16``, ``fp16``:
    a 16-bit run loads its own kernels, 11 MiB more for bf16 here; each is probed once).
    ``first_use``: what ``first_use.pay`` measured in the process the prediction is for (the part of
    the first-use cost it had not paid yet); None for a fresh process (the probe's measure of it)."""
    if dtype not in DTYPES:
        raise ValueError(f"runtime_bytes: dtype {dtype!r} is not one of {DTYPES}")
    if kind != "cpu":
        return (0, 0)
    override = os.environ.get(ENV)
    if override is not None:
        return _parse_override(override)
    fresh, construction, training = _measured(dtype)
    paid_here = fresh if first_use is None else first_use
    return (construction + paid_here, training + paid_here)


@functools.lru_cache(maxsize=None)
def _measured(dtype: str) -> tuple[int, int, int]:
    """The probe's (first use, construction, training), from the kept file or probed now."""
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


def probe(dtype: str = "fp32") -> tuple[int, int, int]:
    """Run ``zeroplus.runtime_probe`` in a child process and return its three numbers; on failure, warn
    and return ``FALLBACK_BYTES``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.update(ALLOCATOR_ENV, ZEROPLUS_ACCELERATOR="cpu", **{ENV: "0,0"})
    cmd = [sys.executable, "-m", "zeroplus.runtime_probe", "--dtype", dtype]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"exit code {done.returncode}: {done.stderr.strip()[-500:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        measured = (int(result["first_use"]), int(result["construction"]), int(result["training"]))
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, subprocess.TimeoutExpired) as err:
        logger.warning("the runtime overhead probe (%s) failed (%s: %s); the memory budget uses %s instead "
                       "(set %s to give it)", " ".join(cmd), type(err).__name__, err, _describe(FALLBACK_BYTES), ENV)
        return FALLBACK_BYTES
    logger.info("runtime overhead measured on this machine: %s", _describe(measured))
    return measured


def _parse_override(value: str) -> tuple[int, int]:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2:
        raise ValueError(f"environment variable {ENV} is {value!r}: give two sizes, 'construction,training' "
                         f"(e.g. '80MiB,100MiB')")
    first, second = (parse_bytes(p, what=f"environment variable {ENV}") for p in parts)
    return (first, second)


def _describe(measured: tuple[int, int, int]) -> str:
    return (f"{measured[0] / 2**20:.1f} MiB on first use, then {measured[1] / 2**20:.1f} MiB from construction, "
            f"{measured[2] / 2**20:.1f} MiB from the first backward")


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


def _read(path: str) -> tuple[int, int, int] | None:
    record = read_record(path)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return ((int(record["first_use"]), int(record["construction"]), int(record["training"]))
                if record is not None else None)
    return None


def _write(path: str, measured: tuple[int, int, int], dtype: str) -> None:
    write_record(path, {"first_use": measured[0], "construction": measured[1], "training": measured[2],
                        **_cache_key(dtype)})
