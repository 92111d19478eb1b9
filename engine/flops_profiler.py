"""FLOPs and MFU (DeepSpeed's ``"flops_profiler"``): the model's FLOPs counted on a real training step, the
achieved TFLOP/s and the model FLOPs utilisation against the device's peak.

At optimizer step ``profile_step`` (1-based, as DeepSpeed counts) every forward, the caller's loss and every
backward of that step run under torch's ``FlopCounterMode``, which counts each matrix product, convolution and
attention kernel by the formula of the op that actually ran (``torch.utils.flop_counter``), so recomputed
activations and tiled losses count as what they cost, and ZeRO's gathers and reductions count nothing. That
gives the FLOPs per optimizer step on this rank, forward (through the loss) and backward apart, and each
module's forward FLOPs (its children's included, read off the counter by hooks around its forward, as
DeepSpeed's profile lists forward FLOPs; ``module_depth`` levels deep, the ``top_modules`` largest at each
level), logged on rank 0 and written to ``output_file`` when one is set. The profiled step itself runs slower
(every op passes through Python), so the rate is taken from the steps after it: every ``steps_per_print`` steps
the FLOPs per step times the steps since the last report, over their wall time, is the achieved TFLOP/s per
rank, and divided by the peak, the MFU (the model's useful FLOPs, not the hardware's: recomputation is counted,
as the profile counts it).

The peak (TFLOP/s of one device in the compute dtype): ``zeroplus.peak_tflops`` when set; else a table of
dense tensor-core peaks for known CUDA and Ascend parts (matched in the device name); on CPU a measured one:
the best of a few timed square matrix products in the compute dtype with the threads the process uses, timed
in a child process once per machine and kept (``measured_cpu_peak``: the products' 12 MiB would otherwise sit
above a small model's training peak, unpredicted). Memory: the counter's per-module table (a few numbers per
module) during the profiled step (the built-in GPT small, 4 x 128: the profiled run's peak 0.3 MiB above an
unprofiled one's; timed in the training process, the products had put 2.5 MiB on it, 14 on GPT tiny's).
"""
from __future__ import annotations

import contextlib
import logging
import platform
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from zeroplus.cache_dir import cache_file, read_record, write_record
from zeroplus.eager import EagerWhileActive

logger = logging.getLogger("zeroplus.engine")

# Dense peak TFLOP/s per device, by a part of the device's name, for 16-bit and 32-bit compute (32-bit: the
# vector units, TF32 not assumed). Vendors' datasheets.
KNOWN_PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989.5, 66.9), "H100 SXM": (989.5, 66.9), "H100 PCIe": (756.0, 51.2), "H100": (989.5, 66.9),
    "A100": (312.0, 19.5), "A800": (312.0, 19.5), "H800": (989.5, 66.9), "L40S": (362.1, 91.6),
    "A10G": (125.0, 31.2), "A10": (125.0, 31.2), "L4": (121.0, 30.3), "V100": (125.0, 15.7),
    "Ascend910B": (313.0, 78.0), "MI300X": (1307.4, 163.4),
}


def known_peak(name: str, dtype: torch.dtype) -> float | None:
    """The table's peak for a device named ``name`` in ``dtype``, or None."""
    for part, (half, single) in KNOWN_PEAKS.items():
        if part.lower() in name.lower():
            return half if dtype in (torch.float16, torch.bfloat16) else single
    return None


_MEASURE = """
import sys, time, torch
n, repeats, dtype, threads = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
torch.mm(a, b)
best = float("inf")
for _ in range(repeats):
    begun = time.perf_counter()
    torch.mm(a, b)
    best = min(best, time.perf_counter() - begun)
print(2 * n ** 3 / best / 1e12)
"""


def measured_cpu_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 4) -> float:
    """TFLOP/s of the best of ``repeats`` timed ``n x n`` matrix products in ``dtype`` on this CPU, with the
    threads this process uses: timed in a child process (its 12 MiB of matrices are not the training
    process's, whose budget does not hold them) once per machine, dtype and thread count, and kept in the cache
    directory; 0.0 (MFU not reported) where the child fails."""
    threads = torch.get_num_threads()
    dtype_name = str(dtype).removeprefix("torch.")
    path = cache_file("cpu-peak", {"host": platform.node(), "machine": platform.machine(), "torch": torch.__version__,
                                   "dtype": dtype_name, "threads": str(threads), "n": str(n)})
    record = read_record(path)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        if record is not None:
            return float(record["tflops"])
    try:
        done = subprocess.run([sys.executable, "-c", _MEASURE, str(n), str(repeats), dtype_name, str(threads)],
                              capture_output=True, text=True, timeout=300, check=True)
        tflops = float(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        logger.warning("flops profiler: timing this CPU's matrix products in a child process failed (%s: %s); "
                       "MFU is not reported (set zeroplus.peak_tflops to give the peak)", type(err).__name__, err)
        return 0.0
    write_record(path, {"tflops": tflops})
    return tflops


def device_peak(accelerator: Any, dtype: torch.dtype, override: float | None) -> tuple[float, str]:
    """The peak TFLOP/s MFU is measured against, and where it comes from."""
    if override:
        return override, "zeroplus.peak_tflops"
    if not accelerator.host_is_device:
        name = accelerator.device_name()
        peak = known_peak(name, dtype)
        if peak is not None:
            return peak, f"{name}, datasheet"
        return 0.0, f"{name}: not in the table; set zeroplus.peak_tflops"
    return measured_cpu_peak(dtype), "measured matmul on this CPU"


class FlopsProfiler:
    """Counts one step's FLOPs; turns later steps' times into TFLOP/s and MFU."""

    def __init__(self, block: Any, peak: Callable[[], tuple[float, str]], params: tuple[int, int],
                 module: torch.nn.Module) -> None:
        """``peak``: gives the peak and its source when first needed (on CPU it times matrix products: after
        the profiled step, below the training peak)."""
        self.block, self._module = block, module
        self._hooks: list[Any] = []
        self._peak = peak
        self._resolved: tuple[float, str] | None = None
        self.params, self.trained = params
        self.flops_per_step: int | None = None  # counted at profile_step
        self.forward_flops = 0
        self._mark = 0  # the count when the current forward began
        self.modules: dict[str, int] = {}
        self._mode: FlopCounterMode | None = None
        self._since: float | None = None  # when the steps of the current report began
        self._steps = 0
        self.last: dict[str, float] = {}

    @property
    def peak(self) -> float:
        """Peak TFLOP/s of one device in the compute dtype."""
        return self._peak_and_source()[0]

    @property
    def peak_source(self) -> str:
        return self._peak_and_source()[1]

    def _peak_and_source(self) -> tuple[float, str]:
        if self._resolved is None:
            self._resolved = self._peak()
        return self._resolved

    @property
    def counting(self) -> bool:
        return self._mode is not None

    def micro_start(self, next_step: int) -> None:
        """Before a forward of optimizer step ``next_step``: start counting if it is the profiled one."""
        if self._mode is None and self.flops_per_step is None and next_step == self.block.profile_step:
            self._mode = _EagerFlopCounter(display=False)  # compiled code runs eagerly in the counted step
            self._mode.__enter__()
            self._watch_modules()

    def _watch_modules(self) -> None:
        """Each module's forward FLOPs (its children's included), read off the counter around its forward."""
        begun: dict[str, list[int]] = {}
        mode = self._mode
        assert mode is not None

        def pre(name: str) -> Any:
            return lambda module, args: begun.setdefault(name, []).append(mode.get_total_flops())

        def post(name: str) -> Any:
            def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
                self.modules[name] = self.modules.get(name, 0) + mode.get_total_flops() - begun[name].pop()
            return hook
        for name, module in self._module.named_modules():
            name = name or type(self._module).__name__
            self._hooks += [module.register_forward_pre_hook(pre(name)), module.register_forward_hook(post(name))]

    def before_backward(self) -> None:
        if self._mode is not None:
            now = self._mode.get_total_flops()
            self.forward_flops += now - self._mark
            self._mark = now

    def after_backward(self) -> None:
        if self._mode is not None:
            self._mark = self._mode.get_total_flops()

    def step_end(self, rank: int) -> None:
        """After the optimizer step: close the count of the profiled step (and report it), or count a step."""
        if self._mode is None:
            if self.flops_per_step is not None:
                if self._since is None:
                    self._since = time.perf_counter()
                else:
                    self._steps += 1
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.flops_per_step = mode.get_total_flops()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._since = time.perf_counter()  # the rate is measured from the next step on
        if rank == 0:
            text = self.profile()
            logger.info("%s", text)
            if self.block.output_file:
                with open(self.block.output_file, "w") as f:
                    f.write(text + "\n")

    def report(self) -> dict[str, float]:
        """Every ``steps_per_print``: TFLOP/s per rank and MFU over the steps since the last report."""
        if self.flops_per_step is None or self._since is None or self._steps == 0:
            return {}
        now = time.perf_counter()
        tflops = self.flops_per_step * self._steps / (now - self._since) / 1e12
        self.last = {"tflops": tflops, "mfu": tflops / self.peak if self.peak > 0 else 0.0,
                     "flops_per_step": float(self.flops_per_step)}
        self._since, self._steps = now, 0
        return self.last

    def profile(self) -> str:
        """The profiled step: parameters, FLOPs forward and backward, the top modules at each depth."""
        total = self.flops_per_step or 0
        lines = [f"flops profiler, step {self.block.profile_step} on this rank: {self.params:,} parameters "
                 f"({self.trained:,} trained); {total / 1e9:.4g} GFLOPs per optimizer step (forward and loss "
                 f"{self.forward_flops / 1e9:.4g}, backward {(total - self.forward_flops) / 1e9:.4g}); peak "
                 f"{self.peak:.4g} TFLOP/s ({self.peak_source})"]
        depth = self.block.module_depth
        by_depth: dict[int, list[tuple[int, str]]] = {}
        root = type(self._module).__name__
        for name, flops in self.modules.items():
            level = 0 if name == root else name.count(".") + 1
            if depth < 0 or level <= depth:
                by_depth.setdefault(level, []).append((flops, name))
        for level in sorted(by_depth):
            top = sorted(by_depth[level], reverse=True)[:max(1, self.block.top_modules)]
            lines.append(f"  depth {level}: " + ", ".join(
                f"{name} {flops / 1e9:.4g} GFLOPs ({100 * flops / max(total, 1):.1f}%)" for flops, name in top))
        return "\n".join(lines)

    def line(self, report: dict[str, float]) -> str:
        return (f"{report['tflops']:.4g} TFLOP/s per rank, MFU {100 * report['mfu']:.2f}% of {self.peak:.4g} "
                f"TFLOP/s ({self.peak_source})")


class _EagerFlopCounter(EagerWhileActive, FlopCounterMode):
    """Torch's FLOP counter, with compiled code run eagerly while it counts (see note: dispatch modes and compiled
    functions)."""
