"""Adam/AdamW over bf16 (or fp32) moments in one pass on the CPU: ``adam_stored.c``, built here and loaded by ctypes.

The stored-states step (``zeroplus/optim/stored_states.py``) otherwise reads each bf16 moment into an fp32
temporary, runs torch's fused kernel and stores the moments back: five passes over memory, 52 bytes an element
against the fp32 kernel's 28. The native loop reads and writes each element once (20 bytes with both moments bf16)
and computes exactly what torch's vectorised CPU kernel computes: the same fp32 operations, the same fused
multiply-adds, the same bf16 rounding (to nearest even, or ``kernels/stochastic_round.py``'s stochastic draw).

``load(directory)`` compiles the source once per machine into ``directory`` (named by a hash of the source, the
compiler's version and the host's CPU; ``-march=native``, ``-ffp-contract=off``) and then checks the kernel
against torch's ``_fused_adam_`` and ``_fused_adamw_`` on random values, bit for bit (decay on and off, Adam and
AdamW, ``maximize``, a ``grad_scale``, and both bf16 roundings against their torch twins). It returns a
``NativeAdam``, or None with the reason in ``unavailable()``: no compiler, a failed build, or a result that differs
(a compiler or CPU whose arithmetic torch's kernel does not share). Nothing else changes then: the caller's own
path runs, with the same values.

Torch's kernel takes the last ``n % lanes`` elements of each tensor in a scalar loop whose rounding can differ
from its vector loop's (``lanes``: 8 floats with AVX2, 16 with AVX-512); ``NativeAdam.step`` leaves those to the
caller, which runs torch's kernel over them, so every element is what torch's kernel gives it on one thread.
Memory: none beyond the tensors given. Held by ``tests/optim/test_native_adam.py``.
See note: stored states in one pass (docs/design-notes.md).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Any

import torch

from .stochastic_round import store

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adam_stored.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the moments' dtypes the loop stores
_loaded: dict[str, NativeAdam | None] = {}
_reasons: dict[str, str] = {}


class NativeAdam:
    """The compiled loop; ``step`` runs it over the leading elements of one tensor."""

    def __init__(self, library: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._fn = library.zeroplus_adam_stored
        self._fn.restype = ctypes.c_int
        pointer, integer, double = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
        self._fn.argtypes = (pointer, pointer, pointer, integer, pointer, integer, ctypes.c_int64, double, double,
                             double, double, double, double, integer, integer, ctypes.c_float, integer, integer)
        self.lanes = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8

    def covered(self, numel: int) -> int:
        """How many leading elements of a tensor of ``numel`` elements ``step`` computes (torch's vector loop's)."""
        return numel - numel % self.lanes

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
             lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, count: float, decoupled: bool,
             maximize: bool, grad_scale: float | None, stochastic: bool) -> int:
        """One step over the first ``covered(n)`` elements of contiguous CPU tensors (fp32 ``param`` and ``grad``,
        fp32 or bf16 moments), in place; ``count``: the step count after this step's increment, as torch's kernel
        reads it; ``grad_scale``: the gradient divided by it and stored back, as torch's kernel does. Returns how
        many elements were stepped."""
        n = self.covered(param.numel())
        moments = (exp_avg, exp_avg_sq)
        if not fits(param, grad) or not all(m.dtype in KINDS and m.is_contiguous() and m.device.type == "cpu"
                                            and m.numel() == param.numel() for m in moments):
            raise ValueError(f"native Adam step: {param.dtype} {param.device} parameter, {grad.dtype} gradient, "
                             f"moments {exp_avg.dtype} and {exp_avg_sq.dtype}: it takes contiguous CPU tensors of "
                             f"one length, fp32 parameter and gradient, fp32 or bf16 moments")
        if n == 0:
            return 0
        self._fn(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), KINDS[exp_avg.dtype],
                 exp_avg_sq.data_ptr(), KINDS[exp_avg_sq.dtype], n, lr, beta1, beta2, weight_decay, eps, count,
                 int(decoupled), int(maximize), grad_scale or 0.0, int(stochastic), torch.get_num_threads())
        return n


def fits(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``NativeAdam.step`` serves this parameter and gradient: contiguous fp32 CPU tensors of one length."""
    return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in (param, grad)) and (
        grad.numel() == param.numel())


def unavailable(directory: str) -> str:
    """Why ``load(directory)`` returned None ('' where it did not, or was not called)."""
    return _reasons.get(directory, "")


def load(directory: str) -> NativeAdam | None:
    """The loop built (once per machine) into ``directory`` and checked against torch's kernel; None where it
    cannot be built or does not match (``unavailable`` says why). Once per process and directory."""
    if directory not in _loaded:
        kernel, reason = _build_and_check(directory)
        _loaded[directory] = kernel
        _reasons[directory] = reason
    return _loaded[directory]


def _host_key() -> str:
    compiler = os.environ.get("CC") or "cc"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        cpu = platform.processor()
    with open(SOURCE, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(source + version.encode() + cpu.encode() + " ".join(FLAGS).encode())
    return digest.hexdigest()[:16]


def _build(directory: str) -> tuple[str | None, str]:
    """The shared library's path (built here unless a build is already there), or None and why."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler!r} not found)"
    path = os.path.join(directory, f"adam_stored-{_host_key()}.so")
    if os.path.exists(path):
        return path, ""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so")
        os.close(fd)
    except OSError as err:
        return None, f"cannot write to {directory}: {err}"
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, SOURCE, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            return None, f"{compiler} failed: {done.stderr.strip()[:500]}"
        os.replace(tmp, path)  # (atomic: ranks that build at once each rename a whole file)
        return path, ""
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{compiler} failed: {err}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_check(directory: str) -> tuple[NativeAdam | None, str]:
    path, reason = _build(directory)
    if path is None:
        return None, reason
    try:
        kernel = NativeAdam(ctypes.CDLL(path), path)
    except OSError as err:
        return None, f"cannot load {path}: {err}"
    differs = _differs_from_torch(kernel)
    return (None, f"{path} differs from torch's fused kernel: {differs}") if differs else (kernel, "")


def _differs_from_torch(kernel: NativeAdam) -> str:
    """'' where the loop equals torch's fused kernel bit for bit on random values in every mode, else the first
    mode that differs."""
    gen = torch.Generator().manual_seed(0)
    n = 64 * kernel.lanes + 5
    base = {"param": torch.randn(n, generator=gen), "grad": torch.randn(n, generator=gen),
            "exp_avg": torch.randn(n, generator=gen) * 0.01, "exp_avg_sq": torch.rand(n, generator=gen) * 1e-3}
    cases: list[dict[str, Any]] = [
        {"decoupled": True, "weight_decay": 0.1, "maximize": False, "grad_scale": None},
        {"decoupled": False, "weight_decay": 0.1, "maximize": False, "grad_scale": None},
        {"decoupled": True, "weight_decay": 0.0, "maximize": True, "grad_scale": None},
        {"decoupled": False, "weight_decay": 0.0, "maximize": False, "grad_scale": 4.0},
    ]
    hyper: dict[str, Any] = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    for case in cases:
        for stored, rounding in ((torch.float32, "nearest"), (torch.bfloat16, "nearest"),
                                 (torch.bfloat16, "stochastic")):
            want = _reference(base, case, hyper, stored, rounding)
            got = {k: v.clone().to(stored) if k.startswith("exp_avg") else v.clone() for k, v in base.items()}
            done = kernel.step(got["param"], got["grad"], got["exp_avg"], got["exp_avg_sq"], count=3.0,
                               stochastic=rounding == "stochastic", **case, **hyper)
            for name in got:
                if not torch.equal(_bits(got[name][:done]), _bits(want[name][:done])):
                    return f"{name} with {case}, moments {stored} rounded {rounding}"
    return ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _reference(base: dict[str, torch.Tensor], case: dict[str, Any], hyper: dict[str, Any], stored: torch.dtype,
               rounding: str) -> dict[str, torch.Tensor]:
    """torch's fused kernel over the moments as ``stored`` holds them (read into fp32), each stored back as
    ``rounding`` says; on one thread (on more, torch's kernel splits the tensor's last elements between threads, and
    each piece ends in its scalar loop)."""
    ref = {k: v.clone() for k, v in base.items()}
    m32, v32 = ref["exp_avg"].to(stored).float(), ref["exp_avg_sq"].to(stored).float()
    fused = torch._fused_adamw_ if case["decoupled"] else torch._fused_adam_
    scale = None if case["grad_scale"] is None else torch.tensor(case["grad_scale"])
    count = torch.tensor(3.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fused([ref["param"]], [ref["grad"]], [m32], [v32], [], [count], amsgrad=False,
              weight_decay=case["weight_decay"], maximize=case["maximize"], grad_scale=scale, found_inf=None,
              **hyper)
    finally:
        torch.set_num_threads(threads)
    for key, value in (("exp_avg", m32), ("exp_avg_sq", v32)):
        ref[key] = torch.empty_like(value, dtype=stored)
        store(ref[key], value, rounding, count)
    return ref
