"""Benchmark: zeroplus at one rank against the plain module, 1 -> 2 rank scaling, and the bytes each
rank hands to collectives per step against the textbook volume (GPT-111M, fp32, CPU, gloo).

Rows, each launched with torchrun (one thread per rank, no glibc trimming):

- ``plain``: the module with ``torch.optim.AdamW`` (fused kernel), clipping to 1.0, one process;
  ``ddp``: the same under DistributedDataParallel, 2 ranks.
- ``zeroplus stage s`` at 1 and at 2 ranks, the same JSON as ``bench_zero.py``.

With glibc's defaults a launch's step time is bimodal: whether the flat gradient buffers (tens to
hundreds of MB) come back from the heap or as fresh pages (up to 135K minor page faults, about
0.2 s, per backward here) depends on the exact allocation sequence, so one engine's launch can be
slow and the next stage's fast, and the other way round in another script. ``--keep-freed`` runs
every row, the plain module included, with glibc keeping freed memory: the engines' own work then
compares alone.

Timings on this kind of machine drift by 40% between launches, so rows run in rounds (every row
once per round, in the same order) and each row's ratio to ``plain`` is taken within a round, then
the median over rounds is quoted. Even so the spread can exceed the differences between rows:
``bench_two_ranks.py`` compares zeroplus with DDP at two ranks inside one launch, steps interleaved.
Per launch: median step time of the steps after ``--warmup``.

- one rank: ``plain step / zeroplus step`` (target >= 0.95: no partitioning work a single process
  does not need);
- scaling: ``T2 / (2 T1)`` with T the tokens per second, i.e. ``step at 1 rank / step at 2 ranks``
  (per-rank micro-batch fixed; target >= 0.9). ``ddp`` against ``plain`` is the reference: on 2
  cores the two ranks share memory bandwidth and gloo's threads compete with compute;
- volume: per rank per step, in units of Psi (parameters x bytes of the communicated dtype), by the
  ZeRO paper's convention (an all-reduce counts twice its buffer; an all-gather its output; a
  reduce-scatter its input): theory 2 Psi at stages 0-2, 3 Psi at stage 3 (less the units kept
  gathered from forward to backward). Counted by wrapping ``torch.distributed``'s functions
  (``bench_worker.CollectiveVolume``).

    python bench/bench_scaling.py                       # 3 rounds, stages 0-3 (about 15 minutes here)
    python bench/bench_scaling.py --stages 3 --rounds 5
    python bench/bench_scaling.py --one-rank --keep-freed    # one rank against the plain module only
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench_zero import launch, volume_per_step

THEORY = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}


def run(framework: str, stage: int, nproc: int, args: argparse.Namespace) -> dict:
    """One launch: median step time after warm-up and the median volume per step (bytes, rank 0)."""
    results = launch(framework, stage, args, malloc=False, nproc=nproc, keep_freed=args.keep_freed)
    step = statistics.median(t for r in results for t in r["step_seconds"][args.warmup:])
    volume, kinds = volume_per_step(results[0], args.warmup)
    return {"step": step, "volume": volume, "kinds": kinds, "params": results[0]["params"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="111m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--keep-freed", action="store_true",
                   help="every row with glibc keeping freed memory (MALLOC_MMAP/TRIM_THRESHOLD_ 4 GiB)")
    p.add_argument("--one-rank", action="store_true", help="only the one-rank rows: plain and zeroplus at 1 rank")
    args = p.parse_args()
    args.dtype, args.micro_batch = "fp32", 1
    stages = [int(s) for s in args.stages.split(",")]
    ranks = (1,) if args.one_rank else (1, 2)
    rows = [("plain", 0, 1)] + [("ddp", 0, 2)] * (not args.one_rank)
    rows += [("zeroplus", s, n) for s in stages for n in ranks]
    rounds: list[dict] = []
    for i in range(args.rounds):
        got = {}
        for framework, stage, nproc in rows:
            got[(framework, stage, nproc)] = run(framework, stage, nproc, args)
            print(f"  round {i + 1}: {framework} stage {stage}, {nproc} rank(s): "
                  f"{got[(framework, stage, nproc)]['step']:.3f} s/step", file=sys.stderr, flush=True)
        rounds.append(got)

    def med(key: tuple, field: str = "step") -> float:
        return statistics.median(r[key][field] for r in rounds)

    def med_ratio(num: tuple, den: tuple) -> float:
        return statistics.median(r[num]["step"] / r[den]["step"] for r in rounds)

    plain_key = ("plain", 0, 1)
    psi = rounds[0][plain_key]["params"] * 4
    allocator = "glibc keeping freed memory" if args.keep_freed else "glibc defaults"
    print(f"GPT {args.model}, fp32, micro-batch 1, sequence {args.seq}, gloo on CPU, one thread per rank, {allocator}; "
          f"{args.rounds} rounds, median of steps {args.warmup + 1}-{args.steps} per launch; ratios taken "
          f"within a round, median over rounds")
    if args.one_rank:
        print(f"{'row':<20}{'1 rank s':>10}{'plain/row':>11}")
        print(f"{'plain':<20}{med(plain_key):>10.3f}{1.0:>11.2f}")
        for s in stages:
            one = ("zeroplus", s, 1)
            print(f"{'zeroplus stage ' + str(s):<20}{med(one):>10.3f}{med_ratio(plain_key, one):>11.2f}")
        return
    header = (f"{'row':<20}{'1 rank s':>10}{'plain/row':>11}{'2 ranks s':>11}{'scale T2/2T1':>14}"
              f"{'volume/Psi':>12}{'theory':>8}  collectives (Psi per step)")
    print(header)
    print("-" * len(header))
    plain = ("plain", 0, 1)
    ddp = ("ddp", 0, 2)
    kinds = ", ".join(f"{k} {b / psi:.2f}" for k, b in rounds[-1][ddp]["kinds"].items())
    print(f"{'plain / ddp':<20}{med(plain):>10.3f}{1.0:>11.2f}{med(ddp):>11.3f}{med_ratio(plain, ddp):>14.2f}"
          f"{med(ddp, 'volume') / psi:>12.2f}{2.0:>8.1f}  {kinds}")
    for s in stages:
        one, two = ("zeroplus", s, 1), ("zeroplus", s, 2)
        kinds = ", ".join(f"{k} {b / psi:.2f}" for k, b in rounds[-1][two]["kinds"].items())
        print(f"{'zeroplus stage ' + str(s):<20}{med(one):>10.3f}{med_ratio(plain, one):>11.2f}{med(two):>11.3f}"
              f"{med_ratio(one, two):>14.2f}{med(two, 'volume') / psi:>12.2f}{THEORY[s]:>8.1f}  {kinds}")


if __name__ == "__main__":
    main()
