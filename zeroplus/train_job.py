"""The main job: train the built-in byte-level GPT on a local text corpus with a zeroplus config.

Runs on every rank (launched by ``zeroplus train`` through torchrun). Rank 0 shows a progress bar
with loss, tokens/s, memory, and where a step's time goes with the MFU (the wall-clock breakdown and the
FLOPs profiler are turned on unless the config sets them), then a summary: final and held-out loss, the
time split and MFU, each rank's peak memory by ledger category, and the checkpoint it saved
(``--save-dir``; ``--resume`` continues from the latest one there).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import zeroplus
from zeroplus.accelerator import get_accelerator
from zeroplus.config import parse_config
from zeroplus.cpu_precision import native_bf16
from zeroplus.data import ByteBatches, corpus_description, read_corpus
from zeroplus.dlrm_job import main as dlrm_main
from zeroplus.job_report import gather_reports, print_memory, resume
from zeroplus.models import GPT, gpt_config
from zeroplus.models.split import split_gpt
from zeroplus.parallel.groups import parallel_groups
from zeroplus.parallel.moe import is_expert
from zeroplus.source_tree import configs_dir

logger = logging.getLogger("zeroplus.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zeroplus train", description=__doc__)
    p.add_argument("--model", choices=["gpt", "dlrm"], default="gpt",
                   help="dlrm: the second main job, a DLRM with sharded tables (zeroplus train --model dlrm --help)")
    p.add_argument("--config", default=None, help="config JSON (default: configs/zero3_bf16.json, or "
                                                   "configs/zero3_fp32.json on a CPU that emulates bf16)")
    p.add_argument("--data", default=None, help="text file or folder (default: the Python standard library)")
    p.add_argument("--size", default="small", help="built-in GPT size: tiny, small, medium, 111m")
    p.add_argument("--experts", type=int, default=0,
                   help="each block's MLP a top-2 mixture of this many experts (split over zeroplus.parallel.expert)")
    p.add_argument("--grouped-experts", action="store_true",
                   help="with --experts: each layer's experts as stacked weights, one batched product per projection")
    p.add_argument("--context", type=int, default=None,
                   help="context-parallel size: ranks that each hold 1/C of every sequence (Ulysses; sets "
                        "zeroplus.parallel.context in the config)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default="runs/zeroplus-gpt", help="checkpoint directory ('' to not save)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--profile", nargs="?", const="runs/profile", default=None, metavar="DIR",
                   help="record a torch.profiler trace of steps 3-5 on every rank into DIR (default runs/profile): "
                        "one rankR.*.pt.trace.json each, for Perfetto, chrome://tracing or TensorBoard")
    return p.parse_args(argv)


def default_config_path() -> str:
    """ZeRO-3 in bf16, or in fp32 when the compute is a CPU that would emulate bf16 (many times slower)."""
    emulated = get_accelerator().name == "cpu" and not native_bf16()
    return os.path.join(configs_dir(), "zero3_fp32.json" if emulated else "zero3_bf16.json")


def with_context(path: str, context: int) -> dict[str, Any]:
    """The config at ``path`` with ``zeroplus.parallel.context`` set (Ulysses)."""
    cfg = json.loads(pathlib.Path(path).read_text())
    cfg.setdefault("zeroplus", {}).setdefault("parallel", {})["context"] = context
    return cfg


def watched(config: str | dict[str, Any]) -> dict[str, Any]:
    """``config`` with the wall-clock breakdown and the FLOPs profiler on where it does not set them: the progress
    bar and the summary show where a step's time goes and the MFU."""
    if isinstance(config, dict):
        cfg = dict(config)
    else:
        with open(config) as f:
            cfg = json.load(f)
    cfg.setdefault("wall_clock_breakdown", True)
    cfg.setdefault("flops_profiler", {"enabled": True, "profile_step": 2})
    return cfg


def time_split(engine: Any, fresh: bool = False) -> str:
    """The step's time split and the MFU, as the progress bar and the summary show them ("" when off).
    ``fresh``: report the steps since the engine's last report first (the summary)."""
    timers, flops = engine.timers, engine.flops
    if fresh and timers is not None and timers.steps:
        timers.report()
    if fresh and flops is not None:
        flops.report()
    parts = []
    if timers is not None and timers.last:
        t = timers.last
        parts.append(f"fwd {t['fwd']:.0f} | bwd {t['bwd']:.0f} (reduce wait {t['bwd_allreduce']:.0f}) | "
                     f"step {t['step']:.0f} | gather wait {t['gather_wait']:.0f} ms")
    if flops is not None and flops.last:
        parts.append(f"MFU {100 * flops.last['mfu']:.1f}%")
    return ", ".join(parts)


def trace(directory: str | None, engine: Any) -> Any:
    """``--profile``: a started ``torch.profiler`` that skips two steps, warms up on none and records three, each
    rank writing its trace into ``directory`` (host activity; the device's too where there is one)."""
    if directory is None:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.accelerator.name == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rank = dist.get_rank() if dist.is_initialized() else 0
    profiler = torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=2, warmup=0, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{rank}"))
    profiler.start()
    return profiler


def main(argv: list[str] | None = None) -> None:
    choice = argparse.ArgumentParser(add_help=False)
    choice.add_argument("--model", choices=["gpt", "dlrm"], default="gpt")
    which, rest = choice.parse_known_args(argv)
    if which.model == "dlrm":
        dlrm_main(rest)
        return
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config: Any = args.config or default_config_path()
    label = str(config)
    if args.context is not None:
        config = with_context(config, args.context)
        label += f" with zeroplus.parallel.context {args.context}"
    config = watched(config)
    parallel = zeroplus.init_parallel(config).topology  # before the model: its split layers need the groups
    if parallel.expert > 1 and args.experts % parallel.expert:
        raise SystemExit(f"zeroplus train: config {label} splits experts over {parallel.expert} ranks; give "
                         f"--experts N with N a multiple of {parallel.expert} (got {args.experts})")
    moe = (dict(moe_experts=args.experts, moe_k=min(2, args.experts), moe_grouped=args.grouped_experts)
           if args.experts else {})
    gpt = GPT(gpt_config(args.size, block_size=max(args.seq_len, 64), **moe))
    n_params = sum(p.numel() * (parallel.expert if is_expert(p) else 1) for p in gpt.parameters())  # all experts
    settings = parse_config(config)[0].zeroplus.parallel
    # this rank's part: tensor slices, pipeline stage (batches then run through engine.train_batch)
    model = split_gpt(gpt, sequence_parallel=settings.sequence_parallel, overlap_chunks=settings.overlap_chunks)
    corpus = read_corpus(args.data)  # the job's data, read before the engine: in the budget's baseline, not its error
    engine = zeroplus.initialize(model, config)
    rank = parallel_groups().coordinates.data  # the data rank picks the batches (context ranks share them)
    main_rank = not dist.is_initialized() or dist.get_rank() == 0  # prints (tensor ranks share a data rank)
    data = ByteBatches(corpus, args.seq_len, engine.train_micro_batch_size_per_gpu(), rank, args.seed)
    if main_rank:
        print(f"zeroplus train: GPT-{args.size} ({n_params / 1e6:.2f}M parameters), {parallel.describe()}, "
              f"config {label}, data: {corpus_description(args.data)}", flush=True)
    if args.resume:
        resume(engine, args.save_dir, main_rank)
    gas = engine.gradient_accumulation_steps()
    start = time.perf_counter()
    loss_value = _train_steps(engine, data, args, parallel.pipeline > 1, main_rank)
    engine.eval()
    with torch.no_grad():
        held = [engine.eval_batch(iter([data.eval_batch(i)] * gas)).item() if parallel.pipeline > 1
                else engine(*data.eval_batch(i)).item() for i in range(4)]
    split = time_split(engine, fresh=True)  # (every rank: a device's timers synchronize)
    saved = engine.save_checkpoint(args.save_dir) if args.save_dir else None
    reports = gather_reports(engine)  # after the save: it counts
    if main_rank:
        _print_summary(engine, args, time.perf_counter() - start, loss_value, sum(held) / len(held), split, saved,
                       reports)
    engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _train_steps(engine: Any, data: ByteBatches, args: argparse.Namespace, pipelined: bool, main_rank: bool) -> float:
    """``args.steps`` optimizer steps (through ``train_batch`` on a pipeline), rank 0's progress bar beside them, and
    ``--profile``'s trace; the last loss."""
    gas = engine.gradient_accumulation_steps()
    tokens_per_step = engine.train_batch_size() * args.seq_len
    bar = tqdm(total=args.steps, disable=not main_rank, unit="step", dynamic_ncols=True)
    profiler = trace(args.profile, engine)
    start, loss_value = time.perf_counter(), float("nan")
    first_step = engine.global_steps
    for step in range(first_step, first_step + args.steps):
        if pipelined:
            loss_value = engine.train_batch(iter([data.batch(step, micro) for micro in range(gas)])).item()
        for micro in range(0 if pipelined else gas):
            x, y = data.batch(step, micro)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_value = loss.item()
        if profiler is not None:
            profiler.step()
        if main_rank:
            elapsed = time.perf_counter() - start
            peak = engine.memory_report().process_peak_above_start_bytes
            done = step + 1 - first_step
            split = time_split(engine)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_per_step * done / elapsed:,.0f}",
                            mem=f"{peak / 2**20:,.0f}MiB", **({"time": split} if split else {}))
            bar.update(1)
    bar.close()
    if profiler is not None:
        profiler.stop()
        if main_rank:
            print(f"profile: torch.profiler traces of steps 3-5 in {args.profile}", flush=True)
    return loss_value


def _print_summary(engine: Any, args: argparse.Namespace, elapsed: float, loss_value: float, held_out: float,
                   split: str | None, saved: str | None, reports: list[dict[str, Any]]) -> None:
    """Rank 0's summary: the losses and throughput, the time split with the MFU, each rank's memory by ledger
    category and what the memory techniques kept from being held, the checkpoint, and a JSON line."""
    tokens_per_step = engine.train_batch_size() * args.seq_len
    print(f"\nfinished {args.steps} steps in {elapsed:.1f}s ({tokens_per_step * args.steps / elapsed:,.0f} "
          f"tokens/s); final train loss {loss_value:.4f}, held-out loss {held_out:.4f} "
          f"(uniform bytes: {math.log(256):.2f})")
    if split:
        profiler = engine.flops
        against = f" of {profiler.peak:.4g} TFLOP/s ({profiler.peak_source})" \
            if profiler is not None and profiler.last else ""
        print(f"time per step (ms, mean of the last steps): {split}{against}")
    print_memory(reports)
    for key in reports[0]["saved"]:  # memory techniques: bytes kept from being held
        print(f"  not held by {key}: peak " + ", ".join(f"rank {r['rank']} "
              f"{r['saved'].get(key, {}).get('peak_bytes', 0) / 2**20:.1f} MiB" for r in reports))
    print(f"checkpoint: {saved}" if saved else "checkpoint: not saved (--save-dir '')")
    print(json.dumps({"final_loss": loss_value, "held_out_loss": held_out, "steps": args.steps}))


def end_process() -> None:
    """The job is done (printed, saved, groups destroyed): end the process without the interpreter's
    teardown, in which a gloo worker freeing a finished collective's tensors can still abort it
    ("terminate called without an active exception", PyTorch PR 179291; see note: exit abort)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    end_process()
