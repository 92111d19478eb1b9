"""Benchmark: which AdamW kernel steps an fp32 shard fastest on the host (for optimizer offload).

For each kernel available here, steps one flat fp32 parameter of ``--numel`` elements (default
55M: one rank's shard of GPT-111M over 2 ranks) ``--steps`` times after one warm-up step, with
``--threads`` torch threads, and prints the median step time, elements per second, and the extra
peak resident memory the step itself adds (VmHWM above the memory held before it, reset per step;
glibc is told to return freed memory so temporaries show). Kernels: torch's AdamW with
``fused=True``, ``foreach=True`` and the plain loop (``foreach=False``), and DeepSpeed's
``DeepSpeedCPUAdam`` when its C++ op builds on this machine.

    python bench/bench_cpu_optimizer.py --threads 1
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


def run_one(kernel: str, numel: int, steps: int) -> None:
    """In a fresh process: print 'median_seconds extra_peak_bytes'."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = _make(kernel, param)
    opt.step()  # creates the states
    times, extras = [], []
    for _ in range(steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        held = rss_bytes("VmRSS")
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        extras.append(rss_bytes("VmHWM") - held)
    print(statistics.median(times), max(extras))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=55_000_000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kernels", default="fused,foreach,loop,deepspeed_cpu_adam")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        run_one(args.one, args.numel, args.steps)
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR="cpu", **MALLOC_ENV)
    print(f"AdamW step over {args.numel / 1e6:.0f}M fp32 elements, {args.threads} thread(s), median of {args.steps}")
    print(f"{'kernel':<22}{'step ms':>10}{'Melem/s':>10}{'extra peak MiB':>16}")
    for kernel in args.kernels.split(","):
        done = subprocess.run([sys.executable, __file__, "--one", kernel, "--numel", str(args.numel), "--steps",
                               str(args.steps), "--threads", str(args.threads)], env=env, capture_output=True,
                              text=True)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["failed"])[-1][:60]
            print(f"{kernel:<22}  unavailable: {reason}")
            continue
        seconds, extra = done.stdout.split()[-2:]
        seconds, extra = float(seconds), int(extra)
        print(f"{kernel:<22}{1e3 * seconds:>10.1f}{args.numel / seconds / 1e6:>10.0f}{extra / 2**20:>16.1f}")


if __name__ == "__main__":
    main()
