"""Benchmark: PEFT LoRA on a Hugging Face Llama at ZeRO-3, zeroplus beside DeepSpeed and FSDP2, 2 ranks.

The same model (``--model``, built from its config; PEFT LoRA rank 8 on every projection, the base
frozen), data and AdamW over the adapters for each engine: zeroplus (``zeroplus.initialize``, frozen
groups: the base partitioned in the compute dtype, nothing else), DeepSpeed ZeRO-3 (its engine over
the adapters' parameters) and FSDP2 as PEFT's FSDP recipe shards it (``fully_shard`` on every decoder
layer and the root). Each row is one torchrun launch of ``bench_worker.py`` for time (glibc keeping
freed memory) and one for memory (glibc returning it: the per-rank peak above the process before the
model). Medians after ``--warmup`` steps; ratios against DeepSpeed and FSDP2 from the same run.

    python bench/bench_lora.py                                  # hf-llama-125m, fp32, 1 x 256 tokens
    python bench/bench_lora.py --dtype bf16 --frameworks zeroplus,fsdp2
"""
from __future__ import annotations

import argparse
import statistics
import sys

from bench_zero import launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", default="zeroplus,deepspeed,fsdp2")
    p.add_argument("--model", default="hf-llama-125m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    args = p.parse_args()
    rows = []
    for framework in args.frameworks.split(","):
        try:
            timed = launch(framework, 3, args, malloc=False, extra=["--lora"], keep_freed=True)
            mem = launch(framework, 3, args, malloc=True, extra=["--lora"])
        except RuntimeError as err:
            print(f"  failed: {framework}: {str(err)[-600:]}", file=sys.stderr, flush=True)
            continue
        step = statistics.median(t for r in timed for t in r["step_seconds"][args.warmup:])
        peak = max(r["peak_above_start_bytes"] for r in mem) / 2**20
        rows.append((framework, step, peak, timed[0]["losses"][-1]))
        print(f"  done: {framework}: {step:.3f} s/step, {peak:.0f} MiB", file=sys.stderr, flush=True)
    print(f"\n{args.model} + LoRA r8, ZeRO-3, {args.dtype}, micro-batch {args.micro_batch} x {args.seq} tokens, "
          f"2 ranks, {args.device}; median of steps {args.warmup + 1}-{args.steps}")
    base = {f: (s, m) for f, s, m, _ in rows}
    print(f"{'engine':<10}{'s/step':>9}{'peak MiB':>10}{'vs DS mem':>11}{'vs FSDP2 mem':>14}{'vs DS time':>12}"
          f"{'loss':>9}")
    for f, step, peak, loss in rows:
        ds, fs = base.get("deepspeed"), base.get("fsdp2")
        print(f"{f:<10}{step:>9.3f}{peak:>10.0f}{(peak / ds[1]) if ds else float('nan'):>11.2f}"
              f"{(peak / fs[1]) if fs else float('nan'):>14.2f}{(step / ds[0]) if ds else float('nan'):>12.2f}"
              f"{loss:>9.4f}")


if __name__ == "__main__":
    main()
