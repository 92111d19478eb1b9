"""What both main jobs (``train_job.py``, ``dlrm_job.py``) print around training: the resume line, and each
rank's peak memory per ledger category gathered onto rank 0 as one table."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def resume(engine: Any, save_dir: str, main_rank: bool) -> None:
    """``--resume``: the latest checkpoint in ``save_dir`` loaded, and said."""
    path, _ = engine.load_checkpoint(save_dir)
    if main_rank:
        print(f"resumed from {path} at step {engine.global_steps}", flush=True)


def gather_reports(engine: Any) -> list[dict[str, Any]]:
    """Every rank's memory report (a collective: every rank calls it; after a save, which it counts)."""
    report = dict(engine.memory_report().to_dict(), rank=dist.get_rank() if dist.is_initialized() else 0)
    if not dist.is_initialized():
        return [report]
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports


def print_memory(reports: list[dict[str, Any]]) -> None:
    """The per-rank table: each ledger category's peak and the process's peak above its start, in MiB."""
    print("per-rank peak memory (MiB):")
    cats = list(reports[0]["categories"])
    print("  " + f"{'rank':<6}" + "".join(f"{c:>16}" for c in cats) + f"{'process':>12}")
    for r in reports:
        print("  " + f"{r['rank']:<6}" + "".join(f"{r['categories'][c]['peak_bytes'] / 2**20:>16.1f}" for c in cats)
              + f"{r['process_peak_above_start_bytes'] / 2**20:>12.1f}")


__all__ = ["gather_reports", "print_memory", "resume"]
