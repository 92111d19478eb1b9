"""Benchmark: zeroplus at two (or more) ranks against DDP, in one launch, steps interleaved.

``bench_scaling.py`` launches every row on its own, and launches of one configuration differ here by up to 40% (a
shared host): more than the differences it looks for. This script builds DDP (the plain module under
``DistributedDataParallel`` with torch's fused AdamW and clipping) and one zeroplus engine per ``--stages`` entry in
the same processes, from the same weights, and runs them in rounds: each row ``--block`` steps in a row, only the last
timed (the first takes whatever the previous row left running: under ``overlap_param_gather`` zeroplus's post-step
all-gathers overlap its own next forward, as in training, and are not charged to another row). The row order rotates
every round. A stage written with a ``g`` (``3g``) is that stage
with every collective on gloo, no shared-memory pair (``zeroplus/shm_pair.py``); with an ``n`` (``3n``), on the native
transport (``zeroplus.transport``: gloo's own reduce-scatter and all-gather into one tensor, as NCCL runs them); with a
``p`` (``3p``), without the
buffer pool (``zero/buffer_pool.py``: every freed unit and gradient buffer freed); with an ``o`` (``1o``), with
``zeroplus.overlap_param_gather`` (stages 1-2's post-step gathers waited by the next forward, the model object mixed
until then; the default waits before step() returns); the rows share one process's heap, so ``--no-pool`` (every row
without it) in launches alternated with plain ones compares cleaner.
Printed: rank 0's median milliseconds of forward, backward and optimizer step (to the
loss's value, the gradients reduced, the step returned) and the total against DDP's.

With zeroplus at one rank stepping as the plain module does (``bench_one_rank.py``), zeroplus's 1 -> 2 rank
scaling is at least DDP's when its two-rank step is no longer than DDP's: the ``x DDP`` column >= 1.

    python bench/bench_two_ranks.py                      # GPT 111m, fp32, stages 0-3, 2 ranks
    python bench/bench_two_ranks.py --stages 1,1g,3,3g                # shared-memory pair against gloo
    python bench/bench_two_ranks.py --stages 1,1g,1n,3,3g,3n          # ... and against the native transport
    python bench/bench_two_ranks.py --stages 3,3p                     # buffer pool against none
    python bench/bench_two_ranks.py --stages 1,1o,2,2o                # post-step gathers waited in step() or not
    python bench/bench_two_ranks.py --stages 3 --no-pool              # ... in launches of their own
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroplus  # noqa: E402
from zeroplus.models import GPT, gpt_config  # noqa: E402
from zeroplus.transports import Native  # noqa: E402


class Row:
    """One engine (or DDP) and its phase times in seconds."""

    def __init__(self, name: str, forward: Callable, backward: Callable, step: Callable,
                 before: Callable[[], None] = lambda: None) -> None:
        self.name, self.phases, self.before = name, (forward, backward, step), before
        self.times: list[tuple[float, float, float]] = []
        self.losses: list[float] = []

    def run(self, x: torch.Tensor, keep: bool) -> None:
        forward, backward, step = self.phases
        self.before()
        start = time.perf_counter()
        loss = forward(x)
        value = loss.item()
        mid = time.perf_counter()
        backward(loss)
        late = time.perf_counter()
        step()
        end = time.perf_counter()
        if keep:
            self.times.append((mid - start, late - mid, end - late))
            self.losses.append(value)

    def median(self, phase: int) -> float:
        return statistics.median(t[phase] for t in self.times)

    def total(self) -> float:
        return statistics.median(sum(t) for t in self.times)


def _rows(base: torch.nn.Module, stages: list[str], no_pool: bool = False) -> list[Row]:
    ddp_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def ddp_step(model: torch.nn.Module = ddp_model, opt: torch.optim.Optimizer = opt) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows = [Row("DDP + fused AdamW", lambda x: ddp_model(x, x), lambda loss: loss.backward(), ddp_step)]
    for spec in stages:
        stage = int(spec.rstrip("gpon"))
        native = spec.endswith("n")
        overlap = spec.endswith("o")
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
               "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
               "zeroplus": {"log_level": "warning", "overlap_param_gather": overlap,
                            "transport": "native" if native else "gloo" if spec.endswith("g") else "auto"}}
        engine = zeroplus.initialize(copy.deepcopy(base), cfg)
        name = f"zeroplus stage {stage}" + (", overlap gather" if overlap else "")
        name += {"pair": ", shm pair", "gloo": ", gloo", "native": ", native"}[engine.dp.transport]
        if spec.endswith("p") or no_pool:
            engine.partition.pool.enabled, name = False, name + ", no pool"

        def before(dp: zeroplus.comm.DataParallelGroup = engine.dp, carrier: Native = engine.dp.carrier) -> None:
            dp.carrier = carrier  # (the engines share the group: each row sets the transport it was built with)
        rows.append(Row(name, lambda x, e=engine: e(x, x), engine.backward, engine.step, before))
    return rows


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    overrides = {"n_embd": args.n_embd} if args.n_embd else {}
    base = GPT(gpt_config(args.model, block_size=max(64, args.seq), **overrides))
    rows = _rows(base, args.stages.split(","), args.no_pool)
    g = torch.Generator().manual_seed(1 + rank)
    vocab = base.config.vocab_size
    for r in range(args.rounds + 1):  # round 0: warm-up
        order = rows[r % len(rows):] + rows[:r % len(rows)]
        for row in order:
            for k in range(args.block):
                x = torch.randint(0, vocab, (1, args.seq), generator=g)
                row.run(x, keep=r > 0 and k == args.block - 1)
    if rank == 0:
        params = sum(q.numel() for q in base.parameters())
        print(f"GPT {args.model} width {base.config.n_embd} ({params / 1e6:.1f}M parameters), fp32, gloo, {world} "
              f"ranks, one thread each, micro-batch 1 x {args.seq}; {args.rounds} rounds of {args.block} steps per "
              f"row, the last timed; rank 0's median ms")
        ref = rows[0].total()
        width = max(34, *(len(row.name) + 2 for row in rows))
        print(f"{'row':<{width}}{'forward':>9}{'backward':>10}{'step':>8}{'total':>9}{'x DDP':>8}")
        for row in rows:
            print(f"{row.name:<{width}}{1e3 * row.median(0):>9.1f}{1e3 * row.median(1):>10.1f}"
                  f"{1e3 * row.median(2):>8.1f}{1e3 * row.total():>9.1f}{ref / row.total():>8.2f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="111m")
    p.add_argument("--n-embd", type=int, default=0, help="the GPT's width (0: its own)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--stages", default="0,1,2,3",
                   help="zeroplus rows; a stage followed by g (3g): every collective on gloo, no shared-memory "
                        "pair; followed by n (3n): the native transport; followed by p (3p): without the buffer pool")
    p.add_argument("--no-pool", action="store_true", help="every zeroplus row without the buffer pool")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=2, help="steps per row per round, the last timed")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--keep-freed", action="store_true",
                   help="glibc keeps freed memory (no page faults from buffers freed and allocated again)")
    args = p.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", ZEROPLUS_ACCELERATOR="cpu")
    if args.keep_freed:
        env.update(MALLOC_MMAP_THRESHOLD_=str(32 << 20), MALLOC_TRIM_THRESHOLD_=str(4 << 30))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", __file__,
           *sys.argv[1:]]
    raise SystemExit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
