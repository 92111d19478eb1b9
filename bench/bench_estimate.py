"""Accuracy of ``zeroplus.estimate``: predicted versus measured peak per rank, on CPU, 2 ranks.

Each run launches ``bench_worker.py`` (zeroplus, torchrun, 2 ranks, glibc told to return freed
memory) and reads each rank's peak resident memory above the process before the model exists;
the prediction is ``zeroplus.estimate`` for the same model, config, rank and input shape, made
in this process before the launch. Prints one row per run and rank, the error in percent, and
the median and largest absolute errors.

    python bench/bench_estimate.py                 # the whole grid (about 15 minutes here)
    python bench/bench_estimate.py --runs s3,s3-shared --steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_worker import ds_config  # noqa: E402
from bench_zero import launch  # noqa: E402

_NVME = {"device": "nvme", "nvme_path": "{tmp}"}
# name: (model, stage, seq, micro-batch, zeroplus block, zero_optimization block)
RUNS = {
    "s0": ("111m", 0, 64, 1, {}, {}),
    "s1": ("111m", 1, 64, 1, {}, {}),
    "s2": ("111m", 2, 64, 1, {}, {}),
    "s3": ("111m", 3, 64, 1, {}, {}),
    "s2-shared": ("111m", 2, 64, 1, {"shared_master_weights": True}, {}),
    "s3-shared": ("111m", 3, 64, 1, {"shared_master_weights": True}, {}),
    "s3-recompute-seq256": ("111m", 3, 256, 4, {"resize_recompute": {"enabled": True}}, {}),
    "s3-seq256": ("111m", 3, 256, 4, {}, {}),
    "s3-offload": ("111m", 3, 64, 1, {}, {"offload_optimizer": _NVME, "sub_group_size": 10**7}),
    "s3-offload-param": ("111m", 3, 64, 1, {}, {"offload_optimizer": _NVME, "offload_param": _NVME,
                                                 "sub_group_size": 10**7}),
    "tiny-s3": ("tiny", 3, 64, 1, {}, {}),
    "small-s0": ("small", 0, 256, 8, {}, {}),
    "small-s1": ("small", 1, 256, 8, {}, {}),
    "small-s2": ("small", 2, 256, 8, {}, {}),
    "small-s3": ("small", 3, 256, 8, {}, {}),
    "medium-s2": ("medium", 2, 256, 4, {}, {}),
    "medium-s3-recompute": ("medium", 3, 256, 4, {"resize_recompute": {"enabled": True}}, {}),
    "small-s3-shared-recompute": ("small", 3, 256, 8, {"shared_master_weights": True,
                                                       "resize_recompute": {"enabled": True}}, {}),
}


def _fill(block: dict, tmp: str) -> dict:
    return json.loads(json.dumps(block).replace("{tmp}", tmp))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()

    import zeroplus
    from zeroplus.models import GPT, gpt_config

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs.split(","):
            model, stage, seq, mb, zp, zero = RUNS[name]
            zp, zero = _fill(zp, tmp), _fill(zero, tmp)
            cfg = ds_config(stage, mb)
            cfg["zeroplus"].update(zp)
            cfg["zero_optimization"].update(zero)
            def build(m=model, s=seq):
                return GPT(gpt_config(m, block_size=max(64, s)))
            t0 = time.perf_counter()
            budgets = [zeroplus.estimate(build, cfg, world_size=2, rank=r, seq_len=seq) for r in range(2)]
            seconds = (time.perf_counter() - t0) / 2
            ns = argparse.Namespace(model=model, seq=seq, steps=args.steps, micro_batch=mb)
            results = launch("zeroplus", stage, ns, malloc=True,
                             extra=["--zeroplus", json.dumps(zp), "--zero", json.dumps(zero)])
            for budget, result in zip(budgets, results):  # the runs save no checkpoint: the training peak
                measured, predicted = result["peak_above_start_bytes"], budget.training_peak_bytes
                error = 100.0 * (predicted - measured) / measured
                rows.append({"run": name, "rank": result["rank"], "predicted": predicted,
                             "phase": budget.training_peak_phase, "measured": measured, "error_pct": error,
                             "estimate_seconds": seconds})
                print(f"{name:<28}{result['rank']:>3}{predicted / 2**30:>10.3f}{budget.training_peak_phase:>10}"
                      f"{measured / 2**30:>10.3f}{error:>+9.1f}%", flush=True)
    errors = [abs(r["error_pct"]) for r in rows]
    print()
    print(f"{'run':<28}{'rank':>4}{'predicted GiB':>15}{'phase':>10}{'measured GiB':>14}{'error':>9}")
    print("-" * 80)
    for r in rows:
        print(f"{r['run']:<28}{r['rank']:>4}{r['predicted'] / 2**30:>15.3f}{r['phase']:>10}"
              f"{r['measured'] / 2**30:>14.3f}{r['error_pct']:>+8.1f}%")
    print(f"\n{len(rows)} predictions: median |error| {statistics.median(errors):.1f}%, "
          f"largest {max(errors):.1f}%; estimate took {statistics.median(r['estimate_seconds'] for r in rows):.1f} s "
          f"per rank (median)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
