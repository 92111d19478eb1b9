"""The second main job: train a DLRM on synthetic Criteo-like data (``zeroplus train --model dlrm``).

Runs on every rank (launched by ``zeroplus train`` through torchrun). The model is Criteo's shape
(``models/dlrm.py``: 13 dense features, 26 tables of the Kaggle set's cardinalities, each at most
``--max-rows`` rows, ``--dim`` columns), its tables sharded over the data-parallel ranks as ``--sharding`` says
(``auto``: the planner's choice per table, ``embeddings/planner.py``; ``--cache-rows``: large tables in files
with their hot rows in memory, ``embeddings/row_cache.py``) and stepped by a row-sparse optimizer, its MLPs
under ZeRO as the config says. Each rank draws its own batches (power-law ids, labels from a fixed teacher).
Rank 0 shows a progress bar with loss, samples/s and memory, then a summary: the plan, final and held-out
loss, each rank's peak memory by ledger category, and the checkpoint saved (``--save-dir``; ``--resume``
continues from the latest one there).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import zeroplus
from zeroplus.embeddings import SparseOptimConfig
from zeroplus.embeddings.planner import plan_tables
from zeroplus.embeddings.sparse_optim import OPTIMIZERS
from zeroplus.embeddings.tables import TableTier
from zeroplus.job_report import gather_reports, print_memory, resume
from zeroplus.models.dlrm import DLRM, criteo_config, synthetic_batch
from zeroplus.source_tree import configs_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zeroplus train --model dlrm", description=__doc__)
    p.add_argument("--config", default=os.path.join(configs_dir(), "dlrm_zero2_fp32.json"),
                   help="config JSON for the dense part (default: configs/dlrm_zero2_fp32.json)")
    p.add_argument("--sharding", choices=["auto", "table", "row", "column"], default="auto",
                   help="every table's sharding (auto: the planner's choice per table)")
    p.add_argument("--max-rows", type=int, default=100_000,
                   help="rows per table at most (DLRM's --max-ind-range; 0: Criteo's full 33.8M rows)")
    p.add_argument("--dim", type=int, default=16, help="embedding columns (the bottom MLP's output)")
    p.add_argument("--cache-rows", type=int, default=0,
                   help="tables of more rows than this live in files under --tier-path, this many hot rows in memory "
                        "(0: every table in memory)")
    p.add_argument("--tier-path", default="runs/zeroplus-dlrm-tables", help="directory of the tables' files")
    p.add_argument("--sparse-optimizer", choices=OPTIMIZERS, default="rowwise_adagrad")
    p.add_argument("--sparse-lr", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default="runs/zeroplus-dlrm", help="checkpoint directory ('' to not save)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with open(args.config) as f:
        config: dict[str, Any] = json.load(f)
    data = zeroplus.init_parallel(config).data  # before the model: its tables shard over these ranks
    world, rank = data.size, data.rank
    cfg = criteo_config(args.dim, args.max_rows or None, args.sharding, cache_rows=args.cache_rows or None)
    tier = TableTier("file", args.tier_path) if args.cache_rows else None
    optimizer = SparseOptimConfig(args.sparse_optimizer, lr=args.sparse_lr)  # type: ignore[arg-type]
    plan = plan_tables(cfg.tables, world, optimizer)
    model = DLRM(cfg, optimizer, seed=args.seed, tier=tier)
    engine = zeroplus.initialize(model, config)
    batch = engine.train_micro_batch_size_per_gpu()
    main_rank = rank == 0
    dense_params = sum(p.numel() for p in model.parameters())
    rows = sum(t.num_embeddings for t in cfg.tables)
    if main_rank:
        print(f"zeroplus train: DLRM ({rows / 1e6:.2f}M rows x {args.dim} in {len(cfg.tables)} tables, "
              f"{dense_params / 1e6:.2f}M dense parameters), {world} ranks, tables {plan.describe()}, "
              f"{args.sparse_optimizer} on the tables, config {args.config}", flush=True)
    if args.resume:
        resume(engine, args.save_dir, main_rank)
    start = time.perf_counter()
    loss_value = _train_steps(engine, cfg, args, rank, main_rank)
    elapsed = time.perf_counter() - start
    rate = engine.train_batch_size() * args.steps / elapsed
    engine.eval()
    with torch.no_grad():
        held = [engine(*synthetic_batch(cfg, batch, torch.Generator().manual_seed(10**9 + 100 * i + rank))).item()
                for i in range(4)]
    saved = engine.save_checkpoint(args.save_dir) if args.save_dir else None
    reports = gather_reports(engine)
    rates = model.embeddings.cache_hit_rates()
    hit_rates: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(hit_rates, rates)
    else:
        hit_rates = [rates]
    if main_rank:
        _print_summary(args, elapsed, rate, loss_value, sum(held) / len(held), reports, hit_rates, saved)
    engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _train_steps(engine: Any, cfg: Any, args: argparse.Namespace, rank: int, main_rank: bool) -> float:
    """``args.steps`` optimizer steps on synthetic batches (each rank its own), rank 0's progress bar beside them;
    the last loss."""
    gas, batch = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    bar = tqdm(total=args.steps, disable=not main_rank, unit="step", dynamic_ncols=True)
    start, loss_value = time.perf_counter(), float("nan")
    first_step = engine.global_steps
    for step in range(first_step, first_step + args.steps):
        for micro in range(gas):
            g = torch.Generator().manual_seed(((args.seed * 1_000_003 + step) * 64 + micro) * 4096 + rank)
            loss = engine(*synthetic_batch(cfg, batch, g))
            engine.backward(loss)
            engine.step()
            loss_value = loss.item()
        if main_rank:
            done = step + 1 - first_step
            peak = engine.memory_report().process_peak_above_start_bytes
            bar.set_postfix(loss=f"{loss_value:.4f}",
                            samples_s=f"{engine.train_batch_size() * done / (time.perf_counter() - start):,.0f}",
                            mem=f"{peak / 2**20:,.0f}MiB")
            bar.update(1)
    bar.close()
    return loss_value


def _print_summary(args: argparse.Namespace, elapsed: float, rate: float, loss_value: float, held_out: float,
                   reports: list[dict[str, Any]], hit_rates: list[Any], saved: str | None) -> None:
    """Rank 0's summary: losses and throughput, each rank's memory by ledger category, the row caches' hit rates,
    the checkpoint, and a JSON line."""
    print(f"\nfinished {args.steps} steps in {elapsed:.1f}s ({rate:,.0f} samples/s); final train loss "
          f"{loss_value:.4f}, held-out loss {held_out:.4f} (a coin flip: {math.log(2):.4f})")
    print_memory(reports)
    for r, rates in enumerate(hit_rates):
        if rates:
            print(f"  rank {r}: row caches of {len(rates)} tables on {args.tier_path}, hit rate "
                  f"{100 * sum(rates.values()) / len(rates):.1f}% (mean over the tables; lowest "
                  f"{min(rates, key=rates.__getitem__)} {100 * min(rates.values()):.1f}%)")
    print(f"checkpoint: {saved}" if saved else "checkpoint: not saved (--save-dir '')")
    print(json.dumps({"final_loss": loss_value, "held_out_loss": held_out, "steps": args.steps,
                      "samples_per_s": rate}))
