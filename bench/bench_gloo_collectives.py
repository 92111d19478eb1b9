"""Benchmark: the collectives a data-parallel step needs, on gloo (CPU), each way zeroplus can issue them.

Launched with torchrun (``--nproc`` ranks, one thread each); every rank holds a random fp32 buffer of
``--numel`` elements (one flat group's gradient or parameters) and each row runs ``--repeats`` times,
after a barrier, all rows once per round (``--rounds``, rows interleaved so that the host's drift
falls on every row alike). Printed: rank 0's median milliseconds per collective, over rounds and
repeats, and the bytes each rank sends by the textbook count (an all-reduce twice its buffer).

Rows, through ``zeroplus.comm.DataParallelGroup`` where zeroplus has a path:

- ``all_reduce``: in place (stage 0; DDP's gradient all-reduce);
- ``reduce_scatter (gloo)``: gloo's own, which holds a copy of its input;
- ``reduces (gloo transport)``: one in-place reduce per rank onto its owner (``transports.PerRank.reduce_each``,
  zeroplus's reduce-scatter of rows on gloo, stages 1-3), the owned row landed in a shard;
- ``exchange (gloo transport)``: two ranks' rows sent point to point, received into a shard
  (``transports.PerRank.exchange``: zeroplus at two ranks writing a fresh shard), and the owner's own row added;
- ``all_gather (gloo)`` and ``broadcasts (gloo transport)``: gloo's own, and zeroplus's in-place broadcasts.

    torchrun --nproc-per-node 2 bench/bench_gloo_collectives.py
    python bench/bench_gloo_collectives.py --numel 25000000 --rounds 5   # launches torchrun itself
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from zeroplus.comm import DataParallelGroup
from zeroplus.transports import PerRank


def _rows(dp: DataParallelGroup, numel: int) -> dict:
    """Each row: a function that runs one collective to completion."""
    n, r = dp.size, dp.rank
    s = numel // n
    buf = torch.randn(n * s)
    shard = torch.empty(s)
    rows = buf.view(n, s)

    gloo = PerRank()
    out = {
        "all_reduce": lambda: dp.all_reduce(buf).wait(),
        "reduce_scatter (gloo)": lambda: dist.reduce_scatter_tensor(shard, buf),
        "reduces (gloo transport)": lambda: gloo.reduce_each(dp, rows, shard, 1.0, False, 0).wait(),
        "all_gather (gloo)": lambda: dist.all_gather_into_tensor(buf, rows[r].clone()),
        "broadcasts (gloo transport)": lambda: gloo.all_gather(dp, buf, rows[r], None, 0).wait(),
    }
    if n == 2:
        out["exchange (gloo transport)"] = lambda: gloo.exchange(dp, rows, shard, 1.0, 0).wait()
    return out


_TEXTBOOK = {"all_reduce": 2.0}  # times the buffer's bytes; every other row sends the buffer's bytes once


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    dp = DataParallelGroup()
    rows = _rows(dp, args.numel)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            for _ in range(args.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    if dp.rank == 0:
        mib = args.numel * 4 / 2**20
        print(f"gloo, {dp.size} ranks, one thread each, {args.numel} fp32 elements ({mib:.0f} MiB) per rank; "
              f"median of {args.rounds} rounds x {args.repeats} repeats")
        print(f"{'collective':<28}{'ms':>9}{'x all_reduce':>14}{'textbook MiB':>14}")
        base = statistics.median(times["all_reduce"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<28}{med * 1e3:>9.1f}{med / base:>14.2f}{_TEXTBOOK.get(name, 1.0) * mib:>14.0f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=7_000_000, help="elements per rank's buffer (default: one block)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, help="ranks, when not launched by torchrun")
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, "--numel", str(args.numel), "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
