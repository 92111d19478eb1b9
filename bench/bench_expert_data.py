"""Benchmark: the expert-data mode against experts replicated over tensor ranks, 4 CPU ranks.

A ``TensorParallelGPT`` with mixture-of-experts MLPs (d 256, 8 heads, 4 layers, vocabulary 4096, 8 experts
top-2, capacity factor 1.25; micro-batch 4 x 128), ZeRO-2, fp32, on 4 gloo ranks in three layouts:

- ``replicated``: tensor 2 x data 2, expert groups from the data ranks (expert 2): each rank holds 4 experts and
  both tensor ranks run them on the same tokens;
- ``expert-data``: tensor 2 x data 2, ``experts_span_tensor`` with expert 4: each rank holds 2 experts and routes
  half its tensor group's tokens;
- ``no tensor``: data 4, expert 4 (no tensor parallelism; the layout without the attention split).

Each layout is launched twice per round: with glibc returning freed memory for the peak (resident, above the
process before the model, max over ranks), and without it for the step time (median after 2 warm-up steps,
slowest rank). Reported: peak, step, the parameters each rank holds (experts and the rest, before ZeRO's
partition), ZeRO's model states per rank (the ledger's parameter + gradient + master + optimizer-state peaks),
and the bytes each rank hands to all-to-alls (the experts' tokens) and to every other collective per step
(``bench_worker.CollectiveVolume``: ZeRO-2's reductions and parameter gather, tensor parallelism's all-reduces, and
in the expert-data mode the tokens' all-gather, which gloo runs as broadcasts). Rounds interleave the
layouts; medians over rounds.

    python bench/bench_expert_data.py                  # 3 rounds (~10 minutes here)
    python bench/bench_expert_data.py --rounds 1 --steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
LAYOUTS = {"replicated": {"tensor": 2, "expert": 2},
           "expert-data": {"tensor": 2, "expert": 4, "experts_span_tensor": True},
           "no tensor": {"expert": 4}}
MICRO, SEQ = 4, 128


def worker(layout: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_worker import CollectiveVolume
    volume = CollectiveVolume()  # (before zeroplus binds torch.distributed's functions)
    import zeroplus
    from zeroplus.ledger import Category
    from zeroplus.models import GPT, gpt_config
    from zeroplus.models.gpt_tp import TensorParallelGPT
    from zeroplus.parallel.groups import _SingleRank
    from zeroplus.parallel.moe import is_expert

    def resident(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    dist.init_process_group("gloo")
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
           "zero_optimization": {"stage": 2},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "parallel": LAYOUTS[layout]}}
    parallel = zeroplus.init_parallel(cfg)
    torch.manual_seed(0)
    start = resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    gcfg = gpt_config("tiny", n_embd=256, n_head=8, n_layer=4, vocab_size=4096, block_size=SEQ, moe_experts=8,
                      moe_k=2, moe_capacity_factor=1.25)
    model = TensorParallelGPT.from_dense(GPT(gcfg, expert_group=_SingleRank()))
    held = {"experts": sum(p.numel() for p in model.parameters() if is_expert(p)),
            "dense": sum(p.numel() for p in model.parameters() if not is_expert(p))}
    engine = zeroplus.initialize(model, cfg)
    g = torch.Generator().manual_seed(parallel.data.rank)
    times, volumes = [], []
    for _ in range(steps):
        x = torch.randint(0, 4096, (MICRO, SEQ), generator=g)
        volume.take()
        t0 = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        volumes.append(volume.take())
    states = sum(engine.ledger.peak_bytes(c) for c in (Category.PARAM, Category.GRAD, Category.MASTER,
                                                        Category.OPTIM_STATE))
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump({"peak": resident("VmHWM") - start, "times": times, "held": held, "states": states,
                   "volume": volumes[-1], "loss": loss.item()}, f)
    dist.barrier()
    os._exit(0)


def launch(layout: str, steps: int, malloc: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
        env.update(OMP_NUM_THREADS="1", ZEROPLUS_ACCELERATOR="cpu", **(MALLOC_ENV if malloc else {}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               os.path.abspath(__file__), "--worker", layout, "--steps", str(steps), "--out", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        try:
            ranks = []
            for r in range(4):
                with open(f"{out}.{r}.json") as f:
                    ranks.append(json.load(f))
            return ranks
        except FileNotFoundError:
            raise RuntimeError(f"{layout} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    peaks: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    steps: dict[str, list[float]] = {k: [] for k in LAYOUTS}
    last: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            ranks = launch(layout, args.steps, malloc=True)
            peaks[layout].append(max(r["peak"] for r in ranks))
            last[layout] = ranks
            timed = launch(layout, args.steps, malloc=False)
            steps[layout].append(max(statistics.median(r["times"][2:]) for r in timed))
    print(f"4 ranks, TensorParallelGPT d 256 x 4 layers, 8 experts top-2, micro-batch {MICRO} x {SEQ}, ZeRO-2 fp32, "
          f"median of {args.rounds} rounds")
    print("| layout | experts / rank | expert params / rank | other params / rank | ZeRO model states MiB/rank "
          "| all-to-all MiB/rank/step | other collectives MiB/rank/step | peak MiB/rank | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 2 ** 20
    for layout, cfg in LAYOUTS.items():
        r0 = last[layout][0]
        others = sum(v for k, v in r0["volume"].items() if k != "all_to_all_single")
        print(f"| {layout} | {8 // cfg['expert']} | {r0['held']['experts'] / 1e6:.2f}M "
              f"| {r0['held']['dense'] / 1e6:.2f}M | {max(r['states'] for r in last[layout]) / mib:.1f} "
              f"| {r0['volume'].get('all_to_all_single', 0) / mib:.1f} | {others / mib:.1f} "
              f"| {statistics.median(peaks[layout]) / mib:.0f} | {statistics.median(steps[layout]):.3f} |")

if __name__ == "__main__":
    main()
