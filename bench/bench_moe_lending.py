"""Hot experts lent to their tokens against routing them (``zeroplus/parallel/dropless_moe.py``), skewed on purpose.

Two gloo ranks (one thread each) split ``--experts`` experts (MLPs ``dim -> 4 dim -> dim``), top-2, dropless.
Every token carries a feature the gate weighs towards expert 0 (``--skew``), so expert 0 gets most first
choices. Per setting, each rank's median forward+backward time of the layer over ``--steps`` steps (after one
warm-up) and the bytes it handed to collectives per step, by kind: routed (``hot_experts`` 0), and the hottest
expert lent (``hot_experts`` 1). Also the capacity-routed ``MoE`` (``moe.py``, capacity factor 1.25: the hot
expert's overflow dropped, every expert run on the same slots), which pays no skew in time and loses tokens.

    python bench/bench_moe_lending.py [--dim 256] [--tokens 2048] [--experts 4] [--steps 6] [--skew 3]
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

import torch
import torch.distributed as dist
from torch import nn


def _worker(args: argparse.Namespace) -> None:
    import zeroplus
    from zeroplus.parallel.dropless_moe import DroplessMoE
    from zeroplus.parallel.moe import MoE
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ep = zeroplus.init_parallel({"zeroplus": {"parallel": {"expert": 2}}}).expert
    rank, out = dist.get_rank(), {}

    def expert() -> nn.Module:
        return nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.dim, generator=g)
    x[:, 0] = 3.0
    for name, make in [("routed", lambda: DroplessMoE(args.dim, expert, args.experts, k=2, ep=ep)),
                       ("hot expert lent", lambda: DroplessMoE(args.dim, expert, args.experts, k=2, hot_experts=1,
                                                               ep=ep)),
                       ("capacity 1.25 (drops)", lambda: MoE(args.dim, expert, args.experts, k=2, ep=ep))]:
        torch.manual_seed(0)
        layer = make()
        with torch.no_grad():
            gate = layer.gate.weight if isinstance(layer, DroplessMoE) else layer.gate.wg.weight
            gate[0, 0] += args.skew
        times, kept = [], None
        for step in range(args.steps + 1):
            ep.bytes_sent.clear()
            dist.barrier()
            t0 = time.perf_counter()
            y, aux = layer(x)
            (y.square().mean() + aux).backward()
            if step:
                times.append(time.perf_counter() - t0)
            if kept is None and isinstance(layer, MoE):
                with torch.no_grad():
                    kept = float((layer.gate(x)[1] >= 0).float().mean())
        out[name] = {"ms": statistics.median(times) * 1e3, "bytes": dict(ep.bytes_sent), "kept": kept}
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skew", type=float, default=3.0, help="gate weight added towards expert 0")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
    else:
        _report(args, _launch(args))


def _launch(args: argparse.Namespace) -> list[dict]:
    """Both ranks' results from one torchrun launch of the workers."""
    flags = ["--dim", args.dim, "--tokens", args.tokens, "--experts", args.experts, "--steps", args.steps,
             "--skew", args.skew]
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "r")
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                  "--worker", "--out", prefix, *map(str, flags)]
        finished = subprocess.run(launch, env=dict(os.environ, OMP_NUM_THREADS="1", ZEROPLUS_ACCELERATOR="cpu"),
                                  capture_output=True, text=True)
        if finished.returncode:
            raise SystemExit(finished.stderr[-3000:])
        return [json.load(open(f"{prefix}.{r}.json")) for r in range(2)]


def _report(args: argparse.Namespace, ranks: list[dict]) -> None:
    print(f"MoE layer, {args.experts} experts of {args.dim} -> {4 * args.dim} -> {args.dim}, top-2, {args.tokens} "
          f"tokens per rank, 2 gloo ranks, routing skewed to expert 0 (rank 0's); median of {args.steps} steps")
    print(f"  {'setting':<24}{'rank 0 ms':>11}{'rank 1 ms':>11}{'slowest':>9}{'KiB sent (rank 0)':>40}")
    for name in ranks[0]:
        a, b = ranks[0][name], ranks[1][name]
        sent = ", ".join(f"{k} {v / 1024:.0f}" for k, v in sorted(a["bytes"].items()))
        kept = f" (kept {100 * a['kept']:.0f}% of choices)" if a["kept"] is not None else ""
        print(f"  {name:<24}{a['ms']:>11.1f}{b['ms']:>11.1f}{max(a['ms'], b['ms']):>9.1f}   {sent}{kept}")


if __name__ == "__main__":
    main()
