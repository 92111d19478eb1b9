"""Benchmark: the engine's own time at one rank, in one process, against the plain module.

One process, world size 1 (gloo on the CPU, NCCL on ``--device cuda``): the plain module with torch's fused
AdamW and one zeroplus engine per ``--variants`` entry (each a JSON object merged into the config's zeroplus
block, so techniques can be turned off one at a time), all built from the same weights. Their steps are
interleaved (round r runs one step of each, in a rotating order), so drift and noise fall on every row alike;
the table gives the median milliseconds of forward, backward and optimizer step, and their sum against the
plain module's. Launch-to-launch differences (up to 12% on this CPU) do not enter.

On a GPU a small model's step is host work (Python, hooks, kernel launches): ``--n-embd`` shrinks the GPT's width
(its layers, heads and calls unchanged) so that on the CPU, too, the step is mostly host work, a stand-in for
what the GPU sees (one H100, GPT 111m x 512 tokens in fp32: plain 20 ms, zeroplus's defaults 67;
docs/benchmark.md).

    python bench/bench_one_rank.py                                     # GPT 111m's calls at width 96
    python bench/bench_one_rank.py --n-embd 0 --seq 64 --stage 1       # the real 111m
    python bench/bench_one_rank.py --untied --stage 3                  # an LM head of its own
    python bench/bench_one_rank.py --variants '{}' '{"resize_recompute": {"enabled": false}}'
    python bench/bench_one_rank.py --device cuda --n-embd 0 --seq 512
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroplus  # noqa: E402
from zeroplus.models import GPT, gpt_config  # noqa: E402

DEFAULT_VARIANTS = ['{}', '{"lean_cross_entropy": false}', '{"resize_recompute": {"enabled": false}}',
                    '{"lean_cross_entropy": false, "resize_recompute": {"enabled": false}}']


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Row:
    """One engine (or the plain module) and its phase times in seconds."""

    def __init__(self, name: str, forward: Callable, backward: Callable, step: Callable) -> None:
        self.name, self.phases = name, {"forward": forward, "backward": backward, "step": step}
        self.times: dict[str, list[float]] = {k: [] for k in self.phases}
        self.losses: list[float] = []

    def run(self, x: torch.Tensor, device: str, keep: bool) -> None:
        _sync(device)
        start = time.perf_counter()
        loss = self.phases["forward"](x)
        _sync(device)
        mid = time.perf_counter()
        self.phases["backward"](loss)
        _sync(device)
        late = time.perf_counter()
        self.phases["step"](None)
        _sync(device)
        end = time.perf_counter()
        self.losses.append(loss.item())
        if keep:
            for k, t in zip(self.times, (mid - start, late - mid, end - late)):
                self.times[k].append(t)

    def median(self, phase: str) -> float:
        return statistics.median(self.times[phase])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="111m")
    p.add_argument("--n-embd", type=int, default=96, help="the GPT's width (0: its own; a multiple of its heads)")
    p.add_argument("--vocab", type=int, default=0, help="the vocabulary (0: the size's own)")
    p.add_argument("--untied", action="store_true", help="an LM head of its own (the GPT ties it to the embedding)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--variants", nargs="*", default=DEFAULT_VARIANTS,
                   help="JSON objects merged into the zeroplus block, one engine each ('{}': the defaults)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ["ZEROPLUS_ACCELERATOR"] = args.device
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    overrides: dict = {"vocab_size": args.vocab} if args.vocab else {}
    if args.untied:
        overrides["tie_head"] = False
    if args.n_embd:
        overrides["n_embd"] = args.n_embd
    torch.manual_seed(0)
    base = GPT(gpt_config(args.model, block_size=max(64, args.seq), **overrides))
    rows = []
    plain = copy.deepcopy(base).to(args.device)
    if args.dtype == "bf16":
        plain = plain.to(torch.bfloat16)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    def plain_step(_: None, opt: torch.optim.Optimizer = opt, model: torch.nn.Module = plain) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rows.append(Row("plain + fused AdamW", lambda x: plain(x, x), lambda loss: loss.backward(), plain_step))
    for variant in args.variants:
        cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
               "gradient_clipping": 1.0, **({"bf16": {"enabled": True}} if args.dtype == "bf16" else {}),
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}},
               "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**6,
               "zeroplus": {"log_level": "warning", **json.loads(variant)}}
        engine = zeroplus.initialize(copy.deepcopy(base), cfg)
        rows.append(Row(f"zeroplus {args.stage} {variant}", lambda x, e=engine: e(x, x), engine.backward,
                        lambda _, e=engine: e.step()))
    g = torch.Generator().manual_seed(1)
    vocab = base.config.vocab_size
    for r in range(args.steps):
        x = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(args.device)
        order = rows[r % len(rows):] + rows[:r % len(rows)]
        for row in order:
            row.run(x, args.device, keep=r >= args.warmup)
    params = sum(q.numel() for q in base.parameters())
    print(f"GPT {args.model}{' untied' if args.untied else ''} width {base.config.n_embd} "
          f"({params / 1e6:.1f}M parameters), {args.dtype}, "
          f"{args.device}, one rank, micro-batch {args.micro_batch} x {args.seq}, {torch.get_num_threads()} threads; "
          f"median ms of the last {args.steps - args.warmup} of {args.steps} interleaved steps")
    ref = rows[0]
    total_ref = sum(ref.median(k) for k in ref.times)
    print(f"{'row':<78}{'forward':>9}{'backward':>9}{'step':>8}{'total':>8}{'x plain':>9}  losses equal")
    for row in rows:
        total = sum(row.median(k) for k in row.times)
        same = "-" if row is ref else ("bitwise" if row.losses == ref.losses else
                                       f"max diff {max(abs(a - b) for a, b in zip(row.losses, ref.losses)):.1e}")
        print(f"{row.name:<78}{1e3 * row.median('forward'):>9.2f}{1e3 * row.median('backward'):>9.2f}"
              f"{1e3 * row.median('step'):>8.2f}{1e3 * total:>8.2f}{total_ref / total:>9.2f}  {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
