"""Benchmark: zeroplus vs DeepSpeed (same JSON config) vs FSDP2 (and DDP), GPT-111M bf16 or fp32, 2 ranks, CPU.

For each framework and stage, two fresh torchrun launches: one for memory with glibc told to
return freed memory (``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``, else
retained heap hides real differences), one for time without it. Reports per-rank peak resident
memory above process start (max over ranks), median step time after the warm-up steps, tokens/s,
and ratios to DeepSpeed at the same stage, and the bytes each rank handed to collectives per step
in units of Psi (parameters x bytes of the compute dtype; an all-reduce counts twice its buffer,
``bench_worker.CollectiveVolume``): the textbook 2 at stages 0-2, 3 at stage 3. FSDP2 "stage 3"
reshards after forward; "stage 2" does not (its parameters stay unsharded between forward and
backward); it has no stage 1.

    python bench/bench_zero.py                      # the full table (about 20 minutes here)
    python bench/bench_zero.py --stages 3 --steps 6 # quicker
    python bench/bench_zero.py --dtype fp32 --frameworks zeroplus,deepspeed,fsdp2,ddp --ledger
    python bench/bench_zero.py --device cuda --nproc 1 --memory-only   # one GPU (an H100: docs/benchmark.md)

On a GPU or NPU node (``--device cuda|npu``) the ranks run NCCL/HCCL, one device each, and the peak is
the device allocator's (``max_memory_allocated`` above what it held before the model existed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


KEEP_FREED_ENV = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def launch(framework: str, stage: int, args: argparse.Namespace, malloc: bool,
           extra: list[str] | None = None, nproc: int = 2, keep_freed: bool = False) -> list[dict]:
    """One torchrun launch; ``malloc``: glibc returns freed memory (for peaks); ``keep_freed``: glibc
    keeps it (no page faults from buffers freed and allocated again; for timing engines alike)."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "result")
        device = getattr(args, "device", "cpu")
        env = dict(os.environ, DS_ACCELERATOR=device, ZEROPLUS_ACCELERATOR=device)
        if device == "cpu":
            env["OMP_NUM_THREADS"] = "1"
        for key in MALLOC_ENV:
            env.pop(key, None)
        if malloc:
            env.update(MALLOC_ENV)
        elif keep_freed:
            env.update(KEEP_FREED_ENV)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(HERE, "bench_worker.py"), "--framework", framework, "--stage", str(stage),
               "--model", args.model, "--seq", str(args.seq), "--steps", str(args.steps), "--out-prefix", prefix,
               "--micro-batch", str(getattr(args, "micro_batch", 1)), "--dtype", getattr(args, "dtype", "bf16"),
               "--device", device, *(extra or [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        results = []
        for rank in range(nproc):
            path = f"{prefix}.{rank}.json"
            if not os.path.exists(path):
                raise RuntimeError(f"{framework} stage {stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            with open(path) as f:
                results.append(json.load(f))
        return results


def volume_per_step(result: dict, warmup: int) -> tuple[float, dict[str, float]]:
    """One rank's collective volume per step after ``warmup`` steps: the median total (bytes) and the
    mean by collective."""
    steps = result["collective_volume"][warmup:]
    kinds: dict[str, float] = {}
    for v in steps:
        for k, b in v.items():
            kinds[k] = kinds.get(k, 0) + b / len(steps)
    return (statistics.median(sum(v.values()) for v in steps) if steps else 0.0), kinds


def row_parser(doc: str | None, rows: dict) -> argparse.ArgumentParser:
    """The arguments every row-table benchmark shares: which rows, stage, model, shape and steps."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(rows))
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model", default="111m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--zeroplus", default="", help="JSON merged into the zeroplus rows' zeroplus block (techniques)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--memory-only", action="store_true", help="one launch per row (times then include trimming)")
    return p


def measure(name: str, framework: str, stage: int, args: argparse.Namespace,
            extra: list[str] | None = None, nproc: int = 2) -> dict:
    """One row: per-rank peak above start (max over ranks, glibc trimming) and the median step time
    after ``args.warmup`` steps (a second launch, without trimming)."""
    mem = launch(framework, stage, args, malloc=True, extra=extra, nproc=nproc)
    timed = mem if getattr(args, "memory_only", False) else launch(framework, stage, args, malloc=False, extra=extra,
                                                                     nproc=nproc)
    step = statistics.median(t for r in timed for t in r["step_seconds"][args.warmup:])
    row = {"row": name, "framework": framework, "stage": stage,
           "peak_gib": max(r["peak_above_start_bytes"] for r in mem) / 2**30, "step_s": step,
           "tokens_per_s": nproc * args.seq * getattr(args, "micro_batch", 1) / step,
           "loss": timed[0]["losses"][-1], "params": timed[0]["params"],
           "ledger": mem[0].get("ledger_live_peak", {}),
           "volume_psi": volume_per_step(timed[0], args.warmup)[0]
           / (timed[0]["params"] * (2 if getattr(args, "dtype", "bf16") == "bf16" else 4))}
    print(f"  done: {name}: {row['peak_gib']:.3f} GiB, {step:.2f} s/step", file=sys.stderr, flush=True)
    return row


def print_ratio_table(rows: list[dict], base_name: str, ds_name: str) -> None:
    """Peak and step time per row, each as a ratio to the ``base_name`` row and the ``ds_name`` row."""
    base = next((r for r in rows if r["row"] == base_name), None)
    ds = next((r for r in rows if r["row"] == ds_name), None)
    wb, wd = len(base_name) + 5, len(ds_name) + 5
    header = (f"{'run':<24}{'peak GiB':>10}{'vs ' + base_name:>{wb}}{'vs ' + ds_name:>{wd}}{'step s':>9}"
              f"{'vs ' + base_name:>{wb}}{'vs ' + ds_name:>{wd}}{'last loss':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        def ratio(key, ref, r=r):
            return f"{r[key] / ref[key]:.2f}" if ref else "-"
        print(f"{r['row']:<24}{r['peak_gib']:>10.3f}{ratio('peak_gib', base):>{wb}}{ratio('peak_gib', ds):>{wd}}"
              f"{r['step_s']:>9.3f}{ratio('step_s', base):>{wb}}{ratio('step_s', ds):>{wd}}{r['loss']:>11.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--frameworks", default="zeroplus,deepspeed,fsdp2",
                   help="any of zeroplus, deepspeed, fsdp2, ddp, plain (ddp, plain: one row each; in bf16 "
                        "under torch.autocast)")
    p.add_argument("--model", default="111m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--memory-only", action="store_true", help="one launch per row (times then include trimming)")
    p.add_argument("--ledger", action="store_true", help="print zeroplus's per-category ledger peaks")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    p.add_argument("--json-file", default="", help="write the rows measured so far as JSON to this file after each row")
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu",
                   help="cuda/npu: NCCL/HCCL, one device per rank, peaks from the device allocator")
    p.add_argument("--nproc", type=int, default=2, help="ranks (one per device)")
    p.add_argument("--vocab", type=int, default=0, help="the built-in GPT's vocabulary (0: the size's own)")
    p.add_argument("--untied", action="store_true", help="the LM head untied from the embedding")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--zeroplus", default="", help="JSON merged into the zeroplus rows' zeroplus block (techniques)")
    p.add_argument("--fsdp2-reduce", choices=["bf16", "fp32"], default="bf16",
                   help="FSDP2 in bf16: the gradients' reduction dtype (MixedPrecisionPolicy.reduce_dtype)")
    p.add_argument("--fsdp2-adamw", choices=["fused", "default"], default="fused",
                   help="FSDP2's AdamW: fused (the fastest) or torch's defaults (no fused/foreach temporaries)")
    args = p.parse_args()
    frameworks = args.frameworks.split(",")
    rows: list[dict] = []

    def keep(row: dict) -> None:  # (a run stopped at a time limit keeps the rows it finished)
        rows.append(row)
        if args.json_file:
            with open(args.json_file, "w") as f:
                json.dump(rows, f)
    for whole in ("plain", "ddp"):  # the references, one row each: the plain module (one rank), DDP
        if whole in frameworks:
            keep(measure(whole, whole, 0, args, nproc=args.nproc))
    for stage in (int(s) for s in args.stages.split(",")):
        for framework in frameworks:
            if framework in ("plain", "ddp") or (framework == "fsdp2" and stage < 2):  # (FSDP2: no stage 0 or 1)
                continue
            extra = (["--adamw", args.fsdp2_adamw] + (["--reduce-fp32"] if args.fsdp2_reduce == "fp32" else [])
                     if framework == "fsdp2" else []) + (
                ["--zeroplus", args.zeroplus] if framework == "zeroplus" and args.zeroplus else []) + (
                ["--vocab", str(args.vocab)] if args.vocab else []) + (["--untied"] if args.untied else [])
            keep(measure(f"{framework} stage {stage}", framework, stage, args, extra=extra, nproc=args.nproc))
    ds = {r["stage"]: r for r in rows if r["framework"] == "deepspeed"}
    fsdp = {r["stage"]: r for r in rows if r["framework"] == "fsdp2"}
    fsdp[1] = fsdp.get(2)  # FSDP2 has no stage 1: compare with its stage-2 equivalent
    where = "gloo, CPU, resident peak" if args.device == "cpu" else f"{args.device}, device allocator peak"
    print(f"GPT {args.model} ({rows[0]['params'] / 1e6:.0f}M parameters), {args.dtype}, {args.nproc} ranks ({where}), "
          f"micro-batch {args.micro_batch}, sequence {args.seq}, {args.steps} steps "
          f"(median of the last {args.steps - args.warmup})")
    header = (f"{'framework':<10}{'stage':>6}{'peak MiB/rank':>15}{'vs DS':>8}{'vs FSDP2':>10}{'step s':>9}"
              f"{'vs DS':>8}{'vs FSDP2':>10}{'tokens/s':>10}{'volume/Psi':>12}")
    print(header)
    print("-" * len(header))
    for r in rows:
        def ratio(key: str, ref: dict | None, r: dict = r) -> str:
            return f"{r[key] / ref[key]:.2f}" if ref else "-"
        b, f = ds.get(r["stage"]), fsdp.get(r["stage"])
        stage = "-" if r["framework"] in ("plain", "ddp") else str(r["stage"])
        print(f"{r['framework']:<10}{stage:>6}{r['peak_gib'] * 1024:>15.0f}{ratio('peak_gib', b):>8}"
              f"{ratio('peak_gib', f):>10}{r['step_s']:>9.3f}{ratio('step_s', b):>8}{ratio('step_s', f):>10}"
              f"{r['tokens_per_s']:>10.1f}{r['volume_psi']:>12.2f}")
    if args.ledger:
        for r in rows:
            if r["framework"] == "zeroplus":
                peaks = ", ".join(f"{k} {v[1] / 2**20:.0f}" for k, v in r["ledger"].items() if v[1])
                print(f"ledger peaks (MiB), {r['row']}: {peaks}")
                at = {k: v[2] for k, v in r["ledger"].items() if len(v) > 2 and v[2]}
                if r["stage"] == 3 and at:  # where the resident peak goes beyond ZeRO-3's 16 B/param/rank floor
                    floor, total, peak = 16 * r["params"] / args.nproc, sum(at.values()), r["peak_gib"] * 2**30
                    cells = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in at.items())
                    print(f"  at the ledger's peak (MiB): {cells}; total {total / 2**20:.0f}. Resident peak "
                          f"{peak / 2**20:.0f} = floor {floor / 2**20:.0f} (16 B/param/rank) + ledger beyond it "
                          f"{(total - floor) / 2**20:.0f} + outside the ledger {(peak - total) / 2**20:.0f}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
