"""Accuracy of the memory budget on Hugging Face models: each family at ZeRO 1-3 and two sequence
lengths, 2 gloo ranks on CPU, the engine's own first-forward prediction against the measured peak
(resident memory above the process before the model exists).

    python bench/bench_hf_budget.py                       # the whole grid, glibc returning freed memory
    python bench/bench_hf_budget.py --families llama --stages 3 --seqs 128 --allocator default

``--allocator trim`` (default) runs with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` at 128 KiB,
which is what the budget assumes (freed memory goes back to the system); ``default`` runs glibc as is.
bf16 rows are added with ``--bf16`` (only where the CPU computes bf16 natively: elsewhere it is slow).
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
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests.hf_models

from bench_zero import MALLOC_ENV  # noqa: E402

from tests.hf_models import FAMILIES  # noqa: E402


def run(family: str, stage: int, seq: int, allocator: str, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "result")
        env = dict(os.environ, ZEROPLUS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        for key in MALLOC_ENV:
            env.pop(key, None)
        if allocator == "trim":
            env.update(MALLOC_ENV)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(HERE, "bench_hf_worker.py"), "--family", family, "--stage", str(stage),
               "--seq", str(seq), "--out-prefix", prefix, *extra]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        out = []
        for rank in range(2):
            path = f"{prefix}.{rank}.json"
            if not os.path.exists(path):
                raise RuntimeError(f"{family} stage {stage} seq {seq} failed:\n{proc.stdout[-2000:]}\n"
                                   f"{proc.stderr[-3000:]}")
            with open(path) as f:
                out.append(json.load(f))
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--seqs", default="128,512")
    p.add_argument("--allocator", choices=["trim", "default"], default="trim")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--mask", action="store_true")
    p.add_argument("--import-first", action="store_true", help="import the model's classes before the measured start")
    p.add_argument("--json")
    args = p.parse_args()
    extra = (["--bf16"] if args.bf16 else []) + (["--mask"] if args.mask else []) + (
        ["--import-first"] if args.import_first else [])
    rows = []
    print(f"{'family':<10}{'stage':>6}{'seq':>6}{'rank':>5}{'predicted MiB':>15}{'measured MiB':>14}{'error':>9}")
    for family in args.families.split(","):
        for stage in map(int, args.stages.split(",")):
            for seq in map(int, args.seqs.split(",")):
                for r in run(family, stage, seq, args.allocator, extra):
                    if r["predicted"] is None:
                        print(f"{family:<10}{stage:>6}{seq:>6}{r['rank']:>5}  no prediction", flush=True)
                        continue
                    error = 100.0 * (r["predicted"] - r["peak_above_start_bytes"]) / r["peak_above_start_bytes"]
                    rows.append(dict(r, family=family, stage=stage, seq=seq, error_pct=error))
                    print(f"{family:<10}{stage:>6}{seq:>6}{r['rank']:>5}{r['predicted'] / 2**20:>15.1f}"
                          f"{r['peak_above_start_bytes'] / 2**20:>14.1f}{error:>+8.1f}%"
                          f"  engine {r['engine_measured'] / 2**20:.1f} model {r['model_bytes'] / 2**20:.1f}",
                          flush=True)
    errors = [abs(r["error_pct"]) for r in rows]
    if errors:
        print(f"\n{len(rows)} predictions ({args.allocator} allocator): median |error| "
              f"{statistics.median(errors):.1f}%, largest {max(errors):.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
