"""Benchmark: zeroplus's memory techniques one by one, against DeepSpeed, GPT-111M bf16, 2 ranks, CPU.

Every row is two fresh torchrun launches of ``bench_worker.py`` (memory with glibc told to return
freed memory, time without), as ``bench_zero.py`` does, at one ZeRO stage (default 3):

- zeroplus with no technique, then each technique alone, then shared master weights plus resize
  recompute (the issue's target pair), then all of them;
- DeepSpeed with the same JSON, and DeepSpeed with its own activation checkpointing of every block
  (the nearest config to zeroplus's checkpointing row).

Swap attention and cpu_checkpointing use the file tier (``--swap-dir``, default a temporary
directory): on a CPU-only machine host memory is the device's, so only files can save memory.

    python bench/bench_memory_techniques.py                 # seq 64, stage 3 (about 20 minutes)
    python bench/bench_memory_techniques.py --seq 128 --micro-batch 4 --rows baseline,recompute,swap
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import measure, print_ratio_table, row_parser  # noqa: E402

OFF = {"resize_recompute": {"enabled": False}}  # (on by default since 2026-11-27: each row names what it has)
ROWS = {
    "baseline": ("zeroplus", OFF, False),
    "shared": ("zeroplus", {**OFF, "shared_master_weights": True}, False),
    "recompute": ("zeroplus", {"resize_recompute": {"enabled": True, "norms": True}}, False),
    "swap": ("zeroplus", {**OFF, "swap_attention": {"enabled": True}, "activation_tier": {"device": "file"}}, False),
    "checkpointing": ("zeroplus", OFF, True),
    "shared+recompute": ("zeroplus", {"shared_master_weights": True,
                                      "resize_recompute": {"enabled": True, "norms": True}}, False),
    "all": ("zeroplus", {"shared_master_weights": True, "resize_recompute": {"enabled": True, "norms": True},
                         "swap_attention": {"enabled": True}, "activation_tier": {"device": "file"}}, False),
    "deepspeed": ("deepspeed", {}, False),
    "deepspeed+checkpointing": ("deepspeed", {}, True),
}


def main() -> None:
    p = row_parser(__doc__, ROWS)
    p.add_argument("--swap-dir", default=None)
    args = p.parse_args()
    swap_dir = args.swap_dir or tempfile.mkdtemp(prefix="zeroplus-bench-swap-")
    rows = []
    for name in args.rows.split(","):
        framework, zp, checkpoint_blocks = ROWS[name]
        if "activation_tier" in zp:
            zp = dict(zp, activation_tier={"device": "file", "path": swap_dir})
        extra = ["--zeroplus", json.dumps(zp)] + (["--checkpoint-blocks"] if checkpoint_blocks else [])
        rows.append(measure(name, framework, args.stage, args, extra))
    print(f"GPT {args.model} ({rows[0]['params'] / 1e6:.0f}M parameters), {args.dtype}, ZeRO stage {args.stage}, "
          f"2 ranks (gloo, CPU), micro-batch {args.micro_batch}, sequence {args.seq}, {args.steps} steps "
          f"(median of the last "
          f"{args.steps - args.warmup}); peak = per-rank resident peak above start, max over ranks")
    print_ratio_table(rows, "baseline", "deepspeed")


if __name__ == "__main__":
    main()
