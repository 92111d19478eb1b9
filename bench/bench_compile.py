"""Benchmark: compiled against eager training, zeroplus beside FSDP2 and DeepSpeed, 2 ranks, CPU (or a device).

Each row is one torchrun launch of ``bench_worker.py`` for time (glibc keeping freed memory, as every
engine's timing here) and one for memory (glibc returning it: the per-rank peak above the process
before the model). Compiled: ``engine.compile()`` for zeroplus and DeepSpeed (the call Accelerate and
the Trainer make), each block's ``compile()`` before ``fully_shard`` for FSDP2 (torchtitan's way).
Step time is the median after ``--warmup`` steps; the compile time is the first step's time less that
median. The ratio column is each compiled row's steps/s over the same engine's eager row.

    python bench/bench_compile.py                                     # GPT small, fp32, ZeRO-1 and 3
    python bench/bench_compile.py --model 111m --dtype fp32 --stages 3 --steps 8
    python bench/bench_compile.py --frameworks zeroplus,fsdp2,deepspeed --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench_zero import launch


def row(framework: str, stage: int, compiled: bool, args: argparse.Namespace) -> dict:
    extra = ["--compile"] if compiled else []
    timed = launch(framework, stage, args, malloc=False, extra=extra, keep_freed=True, nproc=args.nproc)
    mem = launch(framework, stage, args, malloc=True, extra=extra, nproc=args.nproc) if not args.time_only else timed
    step = statistics.median(t for r in timed for t in r["step_seconds"][args.warmup:])
    first = max(r["step_seconds"][0] for r in timed)
    out = {"framework": framework, "stage": stage, "compiled": compiled, "step_s": step,
           "compile_s": max(0.0, first - step), "peak_mib": max(r["peak_above_start_bytes"] for r in mem) / 2**20,
           "loss": timed[0]["losses"][-1]}
    print(f"  done: {framework} stage {stage} {'compiled' if compiled else 'eager'}: {step:.3f} s/step",
          file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", default="zeroplus,fsdp2,deepspeed")
    p.add_argument("--stages", default="1,3")
    p.add_argument("--model", default="small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    p.add_argument("--time-only", action="store_true", help="one launch per row (no memory launch)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (one per device)")
    args = p.parse_args()
    rows = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for framework in args.frameworks.split(","):
            if framework == "fsdp2" and stage not in (2, 3):
                continue  # FSDP2 has no stage 1
            for compiled in (False, True):
                try:
                    rows.append(row(framework, stage, compiled, args))
                except RuntimeError as err:
                    print(f"  failed: {framework} stage {stage} compiled={compiled}: {str(err)[-400:]}",
                          file=sys.stderr, flush=True)
    print(f"\n{args.model} GPT, {args.dtype}, micro-batch {args.micro_batch} x {args.seq} tokens, {args.nproc} ranks, "
          f"{args.device}; median of steps {args.warmup + 1}-{args.steps}")
    print(f"{'engine':<10}{'stage':>6}{'mode':>10}{'s/step':>9}{'steps/s':>9}{'x eager':>9}{'compile s':>11}"
          f"{'peak MiB':>10}{'loss':>9}")
    eager = {(r["framework"], r["stage"]): r["step_s"] for r in rows if not r["compiled"]}
    for r in rows:
        base = eager.get((r["framework"], r["stage"]))
        ratio = f"{base / r['step_s']:.2f}" if base else "-"
        print(f"{r['framework']:<10}{r['stage']:>6}{'compiled' if r['compiled'] else 'eager':>10}{r['step_s']:>9.3f}"
              f"{1 / r['step_s']:>9.2f}{ratio:>9}{r['compile_s'] if r['compiled'] else 0:>11.1f}"
              f"{r['peak_mib']:>10.0f}{r['loss']:>9.4f}")


if __name__ == "__main__":
    main()
