"""Tensor- and pipeline-parallel timing on CPU, 2 ranks (torchrun, gloo, one thread per rank).

1. Tensor parallel (data 1 x tensor 2), the built-in GPT: median step time of plain tensor
   parallelism, sequence parallelism with its collectives in one piece (``overlap_chunks`` 1), and
   cut into 2 and 4 chunks so that chunk i+1 communicates while chunk i computes.
2. Pipeline (data 1 x pipeline 2), 1F1B and interleaved (2 virtual stages per rank): for m
   micro-batches per batch, each stage's busy time (its forwards and backwards) against the batch's
   wall time without the optimizer step; the measured bubble ``1 - busy / wall`` (mean of the
   stages) beside the ideal ``(P - 1) / (m + P - 1)``, and ``((P - 1) / v) / (m + (P - 1) / v)``
   interleaved; and interleaved with one extra warm-up forward per stage (``extra_warmup``); with each
   stage's time waiting in receives (the bubble and the transfers not hidden).

    python bench/bench_parallel.py [--size medium] [--seq 256] [--micro-batch 4] [--steps 6]

What gloo on 2 cores can show: both ranks share two cores with gloo's own threads, so a collective
in flight competes with the matmul it is meant to hide behind; overlap can only win what waiting
costs, and chunking adds per-chunk overhead. Timings drift by up to 40% between runs here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _tp_worker(args: argparse.Namespace) -> dict:
    import zeroplus
    from zeroplus.models import GPT, gpt_config
    from zeroplus.models.gpt_tp import TensorParallelGPT
    out = {}
    for name, sp, chunks in [("plain", False, 1), ("sequence parallel", True, 1),
                             ("sequence parallel, 2 chunks", True, 2), ("sequence parallel, 4 chunks", True, 4)]:
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
               "zeroplus": {"log_level": "warning", "memory_estimate": False,
                            "parallel": {"tensor": 2, "sequence_parallel": sp, "overlap_chunks": chunks}}}
        zeroplus.init_parallel(cfg)
        torch.manual_seed(0)
        model = TensorParallelGPT.from_dense(GPT(gpt_config(args.size, block_size=args.seq)), sequence_parallel=sp,
                                             overlap_chunks=chunks)
        engine = zeroplus.initialize(model, cfg)
        x = torch.randint(0, 256, (args.micro_batch, args.seq))
        times = []
        for step in range(args.steps + 2):
            dist.barrier()
            start = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            if step >= 2:
                times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
        engine.destroy()
    return out


def _pp_worker(args: argparse.Namespace) -> dict:
    import zeroplus
    from zeroplus.models import GPT, gpt_config
    from zeroplus.models.gpt_pipe import gpt_pipeline_layers, gpt_pipeline_loss
    from zeroplus.parallel.pipeline import PipelineModule
    out = {}
    for v, m, extra in [(1, 1, 0), (1, 2, 0), (1, 4, 0), (1, 8, 0), (2, 2, 0), (2, 4, 0), (2, 8, 0), (2, 4, 1),
                         (2, 8, 1)]:
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": m,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1},
               "zeroplus": {"log_level": "warning", "memory_estimate": False, "parallel": {"pipeline": 2}}}
        zeroplus.init_parallel(cfg)
        torch.manual_seed(0)
        model = PipelineModule(gpt_pipeline_layers(GPT(gpt_config(args.size, block_size=args.seq))),
                               gpt_pipeline_loss, virtual_stages=v, extra_warmup=bool(extra))
        engine = zeroplus.initialize(model, cfg)
        busy, stepping = [0.0], [0.0]

        def timed(fn, acc):
            def run(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    acc[0] += time.perf_counter() - t
            return run
        model.forward = timed(model.forward, busy)
        engine.backward_stage = timed(engine.backward_stage, busy)
        engine._step.step = timed(engine._step.step, stepping)
        x = torch.randint(0, 256, (args.micro_batch, args.seq))
        fractions, walls, waits = [], [], []
        for batch in range(args.steps + 1):
            busy[0] = stepping[0] = 0.0
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(iter([(x, x)] * m))
            wall = time.perf_counter() - start - stepping[0]
            if batch >= 1:
                fractions.append(1.0 - busy[0] / wall)
                walls.append(wall)
                waits.append(model.last_recv_wait)
        out[f"{v},{m},{extra}"] = {"bubble": statistics.median(fractions), "wall": statistics.median(walls),
                                   "recv_wait": statistics.median(waits)}
        engine.destroy()
    return out


def _worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = _tp_worker(args) if args.worker == "tp" else _pp_worker(args)
    with open(f"{args.out}.{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _launch(kind: str, args: argparse.Namespace) -> list[dict]:
    from bench_worker import torchrun
    return torchrun(__file__, ["--worker", kind, "--size", args.size, "--seq", str(args.seq), "--micro-batch",
                               str(args.micro_batch), "--steps", str(args.steps)], 2, kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="medium")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--only", choices=["tp", "pp"], default=None, help="run one of the two parts")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.only in (None, "tp"):
        _print_tp(_launch("tp", args), args)
    if args.only in (None, "pp"):
        _print_pp(_launch("pp", args), args)


def _print_tp(tp: list[dict], args: argparse.Namespace) -> None:
    print(f"tensor parallel, data 1 x tensor 2, GPT-{args.size}, micro-batch {args.micro_batch} x seq {args.seq}, "
          f"ZeRO-1 fp32; median of {args.steps} steps (rank 0 / rank 1)")
    base = tp[0]["plain"]
    print(f"  {'setting':<32}{'step s':>16}{'vs plain':>10}")
    for name in tp[0]:
        print(f"  {name:<32}{tp[0][name]:>8.3f}/{tp[1][name]:<7.3f}{tp[0][name] / base:>10.2f}")


def _print_pp(pp: list[dict], args: argparse.Namespace) -> None:
    print(f"\npipeline, data 1 x pipeline 2, GPT-{args.size} as {gpt_layers(args.size)} layers; v virtual stages per "
          f"rank (1: 1F1B, 2: interleaved); median of {args.steps} batches, optimizer step excluded")
    print(f"  {'v':<4}{'micro-batches':<16}{'+1 warm-up':>11}{'wall s':>10}{'bubble stage 0':>16}{'stage 1':>10}"
          f"{'mean':>8}{'ideal':>8}{'recv wait s (0 / 1)':>22}")
    for key, r0 in pp[0].items():
        r1 = pp[1][key]
        v, m, extra = (int(k) for k in key.split(","))
        ideal = (1 / v) / (m + 1 / v)  # (P - 1) / v of idle micro-batch slots, P = 2
        waits = f"{r0['recv_wait']:.3f} / {r1['recv_wait']:.3f}"
        print(f"  {v:<4}{m:<16}{'yes' if extra else 'no':>11}{r0['wall']:>10.3f}{r0['bubble']:>16.2f}"
              f"{r1['bubble']:>10.2f}{(r0['bubble'] + r1['bubble']) / 2:>8.2f}{ideal:>8.2f}{waits:>22}")


def gpt_layers(size: str) -> int:
    from zeroplus.models import gpt_config
    return gpt_config(size).n_layer + 2


if __name__ == "__main__":
    main()
