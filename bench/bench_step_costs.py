"""Benchmark: what one steady training step asks of a GPU, counted without one.

Each row is a torchrun launch of ``bench_worker.py --count-ops``: a few steps of the GPT (default ``small``: 4
layers, width 128, fp32, micro-batch 1 x 64), the last under ``bench_worker.StepCensus``, which counts at torch's
dispatcher the aten kernels the step runs (views and allocations left out), the host syncs (a value read on the
host: ``item()``, ``bool()``) and the collective launches (``c10d`` ops). On a GPU each kernel is a launch and
each sync a stall of the host, so these are the costs a GPU step pays for host work, measured on any machine.
Rows: the plain module with torch's fused AdamW, DDP, FSDP2 (``fully_shard`` per block and root), DeepSpeed
(the same JSON) and zeroplus stages 0-3 on the native transport (``zeroplus.transport``: one launch per
collective, as NCCL runs them; the memory techniques it leaves unset run as an accelerator's rule chooses them,
``"techniques_by_default": "where_needed"``, ``--techniques-by-default where_they_pay`` for the CPU's), at 1 and 4
ranks; the step's loss is read after the counted step, outside it.

    python bench/bench_step_costs.py                       # the table, 1 and 4 ranks (a few minutes here)
    python bench/bench_step_costs.py --ranks 4 --frameworks fsdp2,zeroplus
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import launch  # noqa: E402

ROWS = {"plain": [0], "ddp": [0], "fsdp2": [3], "deepspeed": [0, 1, 2, 3], "zeroplus": [0, 1, 2, 3]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ranks", default="1,4")
    p.add_argument("--frameworks", default=",".join(ROWS))
    p.add_argument("--techniques-by-default", default="where_needed", choices=["where_needed", "where_they_pay"],
                   help="zeroplus's rule for the memory techniques left unset: an accelerator's (the default here: "
                        "this table counts what a GPU step asks) or the CPU's")
    args = p.parse_args()
    args.dtype, args.micro_batch, args.device = "fp32", 1, "cpu"
    print(f"GPT {args.model}, fp32, micro-batch 1 x {args.seq}, gloo; per steady step (the last of {args.steps}), "
          f"rank 0; zeroplus on the native transport, its techniques left unset run {args.techniques_by_default}")
    print(f"{'ranks':>5}  {'row':<22}{'kernels':>9}{'x plain':>9}{'syncs':>7}{'launches':>10}  collectives")
    for nproc in (int(r) for r in args.ranks.split(",")):
        plain = None
        for framework in args.frameworks.split(","):
            if framework == "ddp" and nproc == 1 or framework == "plain" and nproc > 1:
                continue
            for stage in ROWS[framework]:
                block = {"transport": "native", "techniques_by_default": args.techniques_by_default}
                extra = ["--count-ops"] + (["--zeroplus", json.dumps(block)] if framework == "zeroplus" else [])
                results = launch(framework, stage, args, malloc=False, extra=extra, nproc=nproc)
                if not results or "ops" not in results[0]:
                    print(f"{nproc:>5}  {framework} {stage}: failed ({results})")
                    continue
                ops = results[0]["ops"]
                if framework == "plain":
                    plain = ops["kernels"]
                name = framework if framework in ("plain", "ddp", "fsdp2") else f"{framework} stage {stage}"
                ratio = f"{ops['kernels'] / plain:.2f}" if plain else "-"
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(ops["by_collective"].items()))
                print(f"{nproc:>5}  {name:<22}{ops['kernels']:>9}{ratio:>9}{ops['syncs']:>7}"
                      f"{ops['collectives']:>10}  {kinds}", flush=True)


if __name__ == "__main__":
    main()
