"""Benchmark: training time blocked per checkpoint save, synchronous against asynchronous.

GPT 111M, ``--nproc`` ranks of one thread each (default 2; torchrun, gloo, CPU), fp32 AdamW at the given ZeRO
stage: a few steps, then ``--saves`` rounds of (one synchronous save, a step, one asynchronous save, a step),
each save into a directory of its own on local disk. Per round: the seconds ``save_checkpoint`` blocked (max
over ranks); for the asynchronous one the call plus what the next step took beyond the step after the
synchronous save (the state is copied while that step's forward and backward run, and its optimizer step waits
for the copy), and the seconds until it was committed (``wait_for_checkpoint`` after the step). Prints the
medians and the ratio async / sync of the blocked time (the target: <= 0.10).

    python bench/bench_checkpoint.py                 # ZeRO-2, 3 rounds
    python bench/bench_checkpoint.py --stage 3 --saves 5
    python bench/bench_checkpoint.py --nproc 1 --saves 5   # a core left free for the save's thread
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zeroplus
    from zeroplus.models import GPT, gpt_config

    torch.manual_seed(0)
    model = GPT(gpt_config("111m", block_size=64))
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": args.stage}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(model, cfg)
    ids = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> float:
        start = time.perf_counter()
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
        return time.perf_counter() - start

    for _ in range(2):
        step()
    rows = []
    for k in range(args.saves):
        start = time.perf_counter()
        engine.save_checkpoint(os.path.join(args.dir, f"sync-{k}"))
        sync = time.perf_counter() - start
        plain = step()
        start = time.perf_counter()
        engine.save_checkpoint(os.path.join(args.dir, f"async-{k}"), async_save=True)
        call = time.perf_counter() - start
        after = step()
        engine.wait_for_checkpoint()
        committed = time.perf_counter() - start
        rows.append((sync, call + max(0.0, after - plain), committed, call, plain, after))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        worst = [tuple(max(r[k][i] for r in gathered) for i in range(6)) for k in range(args.saves)]
        with open(args.out, "w") as f:
            json.dump(worst, f)
    engine.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one core each: fewer ranks than cores leave "
                                                            "the save's thread a core, as a GPU run does)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", ZEROPLUS_ACCELERATOR="cpu", DS_ACCELERATOR="cpu")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", "--stage", str(args.stage), "--saves", str(args.saves), "--dir", tmp, "--out", out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr[-4000:])
        with open(out) as f:
            rows = json.load(f)
    sync, blocked, committed, call, plain, after = (statistics.median(r[i] for r in rows) for i in range(6))
    print(f"GPT 111m, {args.nproc} ranks of one core each (gloo, CPU, {os.cpu_count()} cores), fp32 AdamW, "
          f"ZeRO-{args.stage}, {args.saves} rounds (medians, max over ranks)")
    print(f"{'save':<14}{'blocked s':>10}{'committed s':>13}")
    print(f"{'synchronous':<14}{sync:>10.3f}{sync:>13.3f}")
    print(f"{'asynchronous':<14}{blocked:>10.3f}{committed:>13.3f}")
    print(f"asynchronous: the call {call:.3f} s; the step after it {after:.3f} s against {plain:.3f} s")
    print(f"blocked async / sync: {blocked / sync:.3f}")


if __name__ == "__main__":
    main()
