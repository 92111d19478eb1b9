"""Benchmark: which AdamW kernel steps an fp32 shard fastest on the host (for optimizer offload).

For each kernel available here, steps one flat fp32 parameter of ``--numel`` elements (default
55M: one rank's shard of GPT-111M over 2 ranks) ``--steps`` times after one warm-up step, with
``--threads`` torch threads, and prints the median step time, elements per second, and the extra
peak resident memory the step itself adds (VmHWM above the memory held before it, reset per step;
glibc is told to return freed memory so temporaries show). Kernels: torch's AdamW with
``fused=True``, ``foreach=True`` and the plain loop (``foreach=False``), and DeepSpeed's
``DeepSpeedCPUAdam`` when its C++ op builds on this machine. ``--dtype bf16``: bf16 parameters over an fp32
master, as mixed-precision training and optimizer offload hold them: each kernel steps the fp32 master and the
step then writes the bf16 copy (``copy_``), the same for every kernel (DeepSpeed's ZeRO does this copy after
its CPU Adam too). ``--threads all``: every core (``os.cpu_count()``).

    python bench/bench_cpu_optimizer.py --threads 1
    python bench/bench_cpu_optimizer.py --threads all --dtype bf16
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from bench_worker import rss_bytes  # the script's own directory is on sys.path
from bench_zero import MALLOC_ENV


def _make(kernel: str, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    kwargs = {"lr": 1e-3, "weight_decay": 0.01}
    if kernel == "deepspeed_cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam([param], adamw_mode=True, **kwargs)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[kernel]
    return torch.optim.AdamW([param], **kwargs, **flags)


def run_one(kernel: str, numel: int, steps: int, dtype: str = "fp32") -> None:
    """In a fresh process: print each step's seconds, then the extra peak bytes."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = _make(kernel, param)
    low = torch.empty(numel, dtype=torch.bfloat16) if dtype == "bf16" else None  # the bf16 parameters

    def step() -> None:
        opt.step()
        if low is not None:
            low.copy_(param.detach())
    step()  # creates the states
    times, extras = [], []
    for _ in range(steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        held = rss_bytes("VmRSS")
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        extras.append(rss_bytes("VmHWM") - held)
    print(*times, max(extras))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=55_000_000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", default="1", help="a number, or all (os.cpu_count())")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: parameters over an fp32 master")
    p.add_argument("--kernels", default="fused,foreach,loop,deepspeed_cpu_adam")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per kernel, interleaved")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.threads = (os.cpu_count() or 1) if args.threads == "all" else int(args.threads)
    torch.set_num_threads(args.threads)
    if args.one:
        run_one(args.one, args.numel, args.steps, args.dtype)
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR="cpu", **MALLOC_ENV)
    what = "fp32 elements" if args.dtype == "fp32" else "elements, fp32 master then the bf16 parameters' copy"
    print(f"AdamW step over {args.numel / 1e6:.0f}M {what}, {args.threads} thread(s), "
          f"median of {args.steps} steps x {args.rounds} rounds")
    print(f"{'kernel':<22}{'step ms':>10}{'Melem/s':>10}{'extra peak MiB':>16}")
    times: dict[str, list[float]] = {k: [] for k in args.kernels.split(",")}
    extra: dict[str, int] = {}
    for _ in range(args.rounds):  # kernels interleaved, each round a fresh process per kernel: noise hits all alike
        for kernel in list(times):
            done = subprocess.run([sys.executable, __file__, "--one", kernel, "--numel", str(args.numel), "--steps",
                                   str(args.steps), "--threads", str(args.threads), "--dtype", args.dtype], env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["failed"])[-1][:60]
                print(f"{kernel:<22}  unavailable: {reason}")
                del times[kernel]
                continue
            *seconds, peak = done.stdout.split()
            times[kernel] += [float(t) for t in seconds]
            extra[kernel] = max(extra.get(kernel, 0), int(peak))
    for kernel, ts in times.items():
        seconds = statistics.median(ts)
        print(f"{kernel:<22}{1e3 * seconds:>10.1f}{args.numel / seconds / 1e6:>10.0f}{extra[kernel] / 2**20:>16.1f}")


if __name__ == "__main__":
    main()
