"""Adam/AdamW over bf16, fp16, fp32 or fp8 moments in one pass on the CPU: ``adam_stored.c``, built here, loaded by
ctypes.

The stored-states step (``zeroplus/optim/stored_states.py``) otherwise reads each stored moment into an fp32 temporary,
runs torch's fused kernel and stores the moments back: five passes over memory for bf16, 52 bytes an element against the
fp32 kernel's 28, and about ten eager passes for fp8. The native loop reads and writes each element once (20 bytes with
both moments bf16, 10 with fp8) and computes exactly what torch's vectorised CPU kernel computes: the same fp32
operations, the same fused multiply-adds, the same bf16 rounding (to nearest even, or ``kernels/stochastic_round.py``'s
stochastic draw), torch's fp16 cast (a tile at a time), and for e4m3 moments ``kernels/block_fp8.py``'s codec a block at
a time (its scales, its stochastic draw, the second moment's correctly rounded root: ``block_fp8.root_``).

``load(directory)`` compiles the source once per machine into ``directory`` (named by a hash of the source, the
compiler's version and the host's CPU; ``-march=native``, ``-ffp-contract=off``) and then checks the kernel
against torch's ``_fused_adam_`` and ``_fused_adamw_`` on random values, bit for bit (decay on and off, Adam and
AdamW, ``maximize``, a ``grad_scale``, both bf16 roundings against their torch twins, fp16, fp8 per 128 and 256
with fp32 scales and mxfp8 per 32 with e8m0 scales through the codec, both roundings, and blocks whose largest
value is 448 times a power of two). It returns a ``NativeAdam``, or None with the reason in ``unavailable()``: no
compiler, a failed build, or a result that differs (a compiler or CPU whose arithmetic torch's kernel does not
share). Nothing else changes then: the caller's own path runs, with the same values.

Torch's kernel takes the last ``n % lanes`` elements of each tensor in a scalar loop whose rounding can differ
from its vector loop's (``lanes``: 8 floats with AVX2, 16 with AVX-512); ``NativeAdam.step`` leaves those to the
caller (``step_blocks``: with the fp8 block they are in), which runs torch's kernel over them, so every element is
what torch's kernel gives it on one thread. Memory: none beyond the tensors given (a block's fp32 values on each
thread's stack). Held by ``tests/optim/test_native_adam.py``.
See note: stored states in one pass (docs/design-notes.md).
"""
from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Any

import torch

from .block_fp8 import E4M3, E8M0, MX_BLOCK, blocks, dequantize_into, quantize, root_
from .stochastic_round import store

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adam_stored.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 3}  # the moments' dtypes the loop stores
_loaded: dict[str, NativeAdam | None] = {}
_reasons: dict[str, str] = {}


class NativeAdam:
    """The compiled loop; ``step`` runs it over the leading elements of one tensor."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.zeroplus_adam_stored
        self._fn.restype = ctypes.c_int
        pointer, integer, double = ctypes.c_void_p, ctypes.c_int, ctypes.c_double
        self._fn.argtypes = (pointer, pointer, pointer, integer, pointer, integer, ctypes.c_int64, double, double,
                             double, double, double, double, integer, integer, ctypes.c_float, integer, integer)
        self._blocks = library.zeroplus_adam_blocks
        self._blocks.restype = ctypes.c_int
        self._blocks.argtypes = (pointer, pointer, pointer, pointer, pointer, pointer, integer, ctypes.c_int64,
                                 ctypes.c_int64, double, double, double, double, double, double, integer, integer,
                                 ctypes.c_float, integer, integer, pointer, pointer, pointer, ctypes.c_int64)
        self.lanes = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8

    def covered(self, numel: int) -> int:
        """How many leading elements of a tensor of ``numel`` elements ``step`` computes (torch's vector loop's)."""
        return numel - numel % self.lanes

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
             lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, count: float, decoupled: bool,
             maximize: bool, grad_scale: float | None, stochastic: bool) -> int:
        """One step over the first ``covered(n)`` elements of contiguous CPU tensors (fp32 ``param`` and ``grad``,
        fp32, bf16 or fp16 moments), in place; ``count``: the step count after this step's increment, as torch's kernel
        reads it; ``grad_scale``: the gradient divided by it and stored back, as torch's kernel does. Returns how
        many elements were stepped."""
        n = self.covered(param.numel())
        moments = (exp_avg, exp_avg_sq)
        if not fits(param, grad) or not all(m.dtype in KINDS and m.is_contiguous() and m.device.type == "cpu"
                                            and m.numel() == param.numel() for m in moments):
            raise ValueError(f"native Adam step: {param.dtype} {param.device} parameter, {grad.dtype} gradient, "
                             f"moments {exp_avg.dtype} and {exp_avg_sq.dtype}: it takes contiguous CPU tensors of "
                             f"one length, fp32 parameter and gradient, fp32, bf16 or fp16 moments")
        if n == 0:
            return 0
        self._fn(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), KINDS[exp_avg.dtype],
                 exp_avg_sq.data_ptr(), KINDS[exp_avg_sq.dtype], n, lr, beta1, beta2, weight_decay, eps, count,
                 int(decoupled), int(maximize), grad_scale or 0.0, int(stochastic), torch.get_num_threads())
        return n

    def covered_blocks(self, numel: int, block: int) -> int:
        """How many leading elements ``step_blocks`` computes: the whole blocks within ``covered(numel)``."""
        return self.covered(numel) // block * block

    def step_blocks(self, param: torch.Tensor, grad: torch.Tensor | GradientSegments, exp_avg: torch.Tensor,
                    exp_avg_scales: torch.Tensor, exp_avg_sq: torch.Tensor, exp_avg_sq_scales: torch.Tensor, *,
                    block: int, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, count: float,
                    decoupled: bool, maximize: bool, grad_scale: float | None, stochastic: bool) -> int:
        """``step`` over e4m3 moments with a power-of-two scale per ``block`` elements (fp32 or e8m0 scales), the
        second moment kept as its square root, as ``kernels/block_fp8.py`` stores them: each whole block within
        ``covered`` read into fp32, stepped and stored again (the root correctly rounded: ``block_fp8.root_``).
        ``grad`` may be ``GradientSegments``: read where they are (a block across two of them gathered on the stack),
        the same values as their gathered tensor, each divided by ``grad_scale`` in place within the elements
        stepped.
        Returns how many elements were stepped."""
        n = self.covered_blocks(param.numel(), block)
        if not fits(param, grad) or not all(
                t.dtype == E4M3 and t.is_contiguous() and t.device.type == "cpu" and t.numel() == param.numel()
                for t in (exp_avg, exp_avg_sq)) or not all(
                t.dtype == exp_avg_scales.dtype and t.dtype in (torch.float32, E8M0) and t.is_contiguous()
                and t.device.type == "cpu" and t.numel() >= n // block for t in (exp_avg_scales, exp_avg_sq_scales)):
            got = grad.dtype if isinstance(grad, torch.Tensor) else grad  # (segments: fp32 CPU tensors, contiguous)
            raise ValueError(f"native Adam step over fp8 moments: {param.dtype} parameter, {got} gradient, "
                             f"moments {exp_avg.dtype} and {exp_avg_sq.dtype}, scales {exp_avg_scales.dtype} and "
                             f"{exp_avg_sq_scales.dtype}: it takes contiguous CPU tensors, e4m3 moments with fp32 "
                             f"or e8m0 scales")
        if n == 0:
            return 0
        if isinstance(grad, GradientSegments):
            pointers, begins, ends, count_segments = grad.arrays()
            address = None
        else:
            pointers = begins = ends = None
            address, count_segments = grad.data_ptr(), 0
        code = self._blocks(param.data_ptr(), address, exp_avg.data_ptr(), exp_avg_scales.data_ptr(),
                            exp_avg_sq.data_ptr(), exp_avg_sq_scales.data_ptr(), int(exp_avg_scales.dtype == E8M0),
                            block, n, lr, beta1, beta2, weight_decay, eps, count,
                            int(decoupled), int(maximize), grad_scale or 0.0, int(stochastic),
                            torch.get_num_threads(), pointers, begins, ends, count_segments)
        if code == -2:
            raise ValueError(f"native Adam step over fp8 moments: blocks of {block} elements (at most 256)")
        if code == -3:
            raise ValueError(f"native Adam step over fp8 moments: gradient segments {grad}: ascending and apart")
        return n


class GradientSegments:
    """A flat gradient of ``numel`` fp32 elements held as several tensors: ``tensors[t]``'s elements (row-major)
    at ``offsets[t]``, zeros between them and after the last (one rank's kept gradients, each parameter's own
    tensor, laid out as its flat group: ``zero/direct_step.py``). ``NativeAdam.step_blocks`` reads them where they
    are; ``gather`` copies a range into one tensor (the chunked step's)."""

    def __init__(self, tensors: list[torch.Tensor], offsets: list[int], numel: int) -> None:
        placed = [(o, t) for o, t in zip(offsets, tensors) if t.numel() > 0]
        ends = [o + t.numel() for o, t in placed]
        if any(o < (ends[i - 1] if i else 0) for i, (o, _) in enumerate(placed)) or (ends and ends[-1] > numel):
            raise ValueError(f"gradient segments at {offsets} of {[t.numel() for t in tensors]} elements in a flat "
                             f"tensor of {numel}: ascending, apart and within it")
        self.tensors = [t for _, t in placed]
        self.offsets = [o for o, _ in placed]
        self.ends = ends
        self.numel = numel

    def __repr__(self) -> str:
        return f"GradientSegments({len(self.tensors)} tensors at {self.offsets[:4]}..., {self.numel} elements)"

    def fits(self) -> bool:
        """Whether the native loop reads them: contiguous fp32 CPU tensors."""
        return all(t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.float32 for t in self.tensors)

    def arrays(self) -> tuple[Any, Any, Any, int]:
        """The C arrays the loop takes: each tensor's address, first and end element."""
        k = len(self.tensors)
        pointers = (ctypes.c_void_p * k)(*[t.data_ptr() for t in self.tensors])
        begins = (ctypes.c_int64 * k)(*self.offsets)
        ends = (ctypes.c_int64 * k)(*self.ends)
        return pointers, begins, ends, k

    def gather(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[a, b)`` in ``out`` (``b - a`` elements), zeros where no tensor is."""
        out.zero_()
        for k in range(bisect.bisect_right(self.ends, a), len(self.tensors)):  # (the first ending after a)
            o, t = self.offsets[k], self.tensors[k]
            if o >= b:
                break
            lo, hi = max(a, o), min(b, self.ends[k])
            out[lo - a:hi - a].copy_(t.reshape(-1)[lo - o:hi - o])
        return out


def fits(param: torch.Tensor, grad: torch.Tensor | GradientSegments) -> bool:
    """Whether ``NativeAdam.step`` serves this parameter and gradient: contiguous fp32 CPU tensors of one length
    (``step_blocks``: or ``GradientSegments`` of that length that fit)."""
    if isinstance(grad, GradientSegments):
        return grad.fits() and grad.numel == param.numel() and fits(param, param)
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


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _host_key() -> str:
    compiler = _compiler()
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
    compiler = _compiler()
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
        kernel = NativeAdam(ctypes.CDLL(path))
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
                                 (torch.bfloat16, "stochastic"), (torch.float16, "nearest")):
            want = _reference(base, case, hyper, stored, rounding)
            got = {k: v.clone().to(stored) if k.startswith("exp_avg") else v.clone() for k, v in base.items()}
            done = kernel.step(got["param"], got["grad"], got["exp_avg"], got["exp_avg_sq"], count=3.0,
                               stochastic=rounding == "stochastic", **case, **hyper)
            for name in got:
                if not torch.equal(_bits(got[name][:done]), _bits(want[name][:done])):
                    return f"{name} with {case}, moments {stored} rounded {rounding}"
        for block, scale_dtype in ((128, torch.float32), (256, torch.float32), (MX_BLOCK, E8M0)):
            for rounding in ("nearest", "stochastic"):
                want = _reference_blocks(base, case, hyper, block, scale_dtype, rounding)
                got = _stored_blocks(base, block, scale_dtype)
                done = kernel.step_blocks(got["param"], got["grad"], got["exp_avg"], got["exp_avg_scale"],
                                          got["exp_avg_sq"], got["exp_avg_sq_scale"], block=block, count=3.0,
                                          stochastic=rounding == "stochastic", **case, **hyper)
                for name in got:
                    upto = done // block if name.endswith("_scale") else done
                    if not torch.equal(_bits(got[name][:upto]), _bits(want[name][:upto])):
                        return f"{name} with {case}, fp8 moments per {block} ({scale_dtype}) rounded {rounding}"
    # moments that a step leaves as they are (beta1 = beta2 = 1, the parameter then NaN and not compared), whose
    # blocks' largest magnitude is 448 times a power of two: their scale is that power, not twice it
    held: dict[str, Any] = {"decoupled": True, "weight_decay": 0.0, "maximize": False, "grad_scale": None}
    still: dict[str, Any] = {"lr": 0.0, "beta1": 1.0, "beta2": 1.0, "eps": 1e-8}
    edge = dict(base, exp_avg=base["exp_avg"].clone(), exp_avg_sq=base["exp_avg_sq"].clone())
    edge["exp_avg"][::MX_BLOCK] = 448 * 2.0 ** -6
    edge["exp_avg_sq"][::MX_BLOCK] = (448 * 2.0 ** -8) ** 2
    for block, scale_dtype in ((128, torch.float32), (256, torch.float32), (MX_BLOCK, E8M0)):
        want = _reference_blocks(edge, held, still, block, scale_dtype, "nearest")
        got = _stored_blocks(edge, block, scale_dtype)
        done = kernel.step_blocks(got["param"], got["grad"], got["exp_avg"], got["exp_avg_scale"], got["exp_avg_sq"],
                                  got["exp_avg_sq_scale"], block=block, count=3.0, stochastic=False, **held, **still)
        for name in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
            upto = done // block if name.endswith("_scale") else done
            if not torch.equal(_bits(got[name][:upto]), _bits(want[name][:upto])):
                return f"{name} of fp8 moments per {block} ({scale_dtype}) whose largest is 448 times a power of two"
    return ""


def _stored_blocks(base: dict[str, torch.Tensor], block: int, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``base`` with its moments as fp8 states hold them: e4m3 codes and a scale per block, the second moment as
    its square root."""
    out = {"param": base["param"].clone(), "grad": base["grad"].clone()}
    n = base["param"].numel()
    for key, value in (("exp_avg", base["exp_avg"].clone()), ("exp_avg_sq", root_(base["exp_avg_sq"].clone()))):
        out[key] = torch.empty(n, dtype=E4M3)
        out[f"{key}_scale"] = torch.empty(blocks(n, block), dtype=scale_dtype)
        quantize(value, out[key], out[f"{key}_scale"], block)
    return out


def _reference_blocks(base: dict[str, torch.Tensor], case: dict[str, Any], hyper: dict[str, Any], block: int,
                      scale_dtype: torch.dtype, rounding: str) -> dict[str, torch.Tensor]:
    """The chunked step's fp8 path on one thread: each moment read into fp32 (the second squared), torch's fused
    kernel, each stored again with its blocks (the second as its correctly rounded square root)."""
    ref = _stored_blocks(base, block, scale_dtype)
    n = ref["param"].numel()
    m32 = dequantize_into(torch.empty(n), ref["exp_avg"], ref["exp_avg_scale"], block)
    v32 = dequantize_into(torch.empty(n), ref["exp_avg_sq"], ref["exp_avg_sq_scale"], block).square_()
    count = _fused_on_one_thread(ref, m32, v32, case, hyper)
    step = count if rounding == "stochastic" else None
    quantize(m32, ref["exp_avg"], ref["exp_avg_scale"], block, step)
    quantize(root_(v32), ref["exp_avg_sq"], ref["exp_avg_sq_scale"], block, step)
    return ref


def _fused_on_one_thread(ref: dict[str, torch.Tensor], m32: torch.Tensor, v32: torch.Tensor, case: dict[str, Any],
                         hyper: dict[str, Any]) -> torch.Tensor:
    """torch's fused kernel over ``ref``'s parameter and gradient and the fp32 moments, in place, at step 3, on one
    thread (on more, torch's kernel splits the tensor's last elements between threads, and each piece ends in its
    scalar loop); returns the step count."""
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
    return count


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _reference(base: dict[str, torch.Tensor], case: dict[str, Any], hyper: dict[str, Any], stored: torch.dtype,
               rounding: str) -> dict[str, torch.Tensor]:
    """torch's fused kernel over the moments as ``stored`` holds them (read into fp32), each stored back as
    ``rounding`` says."""
    ref = {k: v.clone() for k, v in base.items()}
    m32, v32 = ref["exp_avg"].to(stored).float(), ref["exp_avg_sq"].to(stored).float()
    count = _fused_on_one_thread(ref, m32, v32, case, hyper)
    for key, value in (("exp_avg", m32), ("exp_avg_sq", v32)):
        ref[key] = torch.empty_like(value, dtype=stored)
        store(ref[key], value, rounding, count)
    return ref
