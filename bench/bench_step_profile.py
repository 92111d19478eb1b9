"""Profile: where one rank's step spends its host and device time, the plain module against zeroplus's stages.

One process, world size 1 (gloo on the CPU, NCCL on ``--device cuda``): the GPT with torch's fused AdamW (under
``torch.autocast`` in bf16), then one zeroplus engine per ``--stages`` entry with the harness's JSON
(``bench_worker.ds_config``; the memory estimate off, so a technique left unset runs as its default does without a
budget). Each row: the median of ``--steps`` timed steps after ``--warmup``, then ``--profiled`` steps under
``torch.profiler``: the operators by their own host time, and on a GPU by their own device time. On a GPU a small
model's step is host work; the two tables say which calls the engine adds (docs/benchmark.md, "One GPU").

    python bench/bench_step_profile.py --device cuda                     # GPT 111m x 512, fp32, stages 0 and 3
    python bench/bench_step_profile.py --model 28m --seq 64 --stages 1   # a quick look on the CPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_worker import adamw, ds_config, plain_step  # noqa: E402

import zeroplus  # noqa: E402
from zeroplus.accelerator import get_accelerator  # noqa: E402
from zeroplus.models import GPT, gpt_config  # noqa: E402


def profile(name: str, step: Callable[[torch.Tensor], None], args: argparse.Namespace, device: torch.device) -> None:
    accel = get_accelerator()
    g = torch.Generator().manual_seed(0)
    timed = args.warmup + args.steps
    xs = [torch.randint(0, 1000, (1, args.seq), generator=g).to(device) for _ in range(timed + args.profiled)]
    times = []
    for x in xs[:timed]:
        accel.synchronize()
        t0 = time.perf_counter()
        step(x)
        accel.synchronize()
        times.append(time.perf_counter() - t0)
    print(f"{name}: median step {1e3 * statistics.median(times[args.warmup:]):.2f} ms", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for x in xs[timed:]:
            step(x)
        accel.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60), flush=True)
    if device.type == "cuda":
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows // 2, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="111m")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--stages", default="0,3")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--rows", type=int, default=22, help="operators in the host-time table")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    os.environ.setdefault("ZEROPLUS_ACCELERATOR", args.device)
    device = get_accelerator().device()

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(gpt_config(args.model, block_size=max(64, args.seq))).to(device)

    plain = model()  # bench_worker's plain row: clipping to 1.0, fused AdamW, autocast in bf16
    profile("plain + fused AdamW", plain_step(plain, plain, adamw(plain),
                                              autocast=torch.bfloat16 if args.dtype == "bf16" else None), args, device)
    del plain
    for stage in (int(s) for s in args.stages.split(",")):
        cfg = ds_config(stage, 1, args.dtype)
        cfg["zeroplus"]["memory_estimate"] = False
        cfg["optimizer"]["params"].pop("torch_adam")
        engine = zeroplus.initialize(model(), cfg)

        def engine_step(x: torch.Tensor, engine: zeroplus.Engine = engine) -> None:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        profile(f"zeroplus stage {stage}", engine_step, args, device)
        engine.destroy()


if __name__ == "__main__":
    main()
