"""One benchmark run on one rank (launched by ``bench_zero.py`` through torchrun).

Builds the GPT, wraps it with zeroplus, DeepSpeed or FSDP2, trains ``--steps`` steps of random
tokens, and writes ``{"peak_above_start_bytes", "step_seconds": [...], ...}`` to
``--out-prefix.RANK.json``. "Start" is this process's resident memory after imports and process
group set-up, before the model exists; the peak is VmHWM (reset at that point).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def start_measuring() -> tuple[int, int]:
    """Join the gloo group, seed, and start the peak count here: (rank, resident bytes now); the peak
    above it is read later as ``rss_bytes("VmHWM") - start``."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    start = rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    return dist.get_rank(), start


def ds_config(stage: int, micro_batch: int = 1, dtype: str = "bf16") -> dict:
    """The JSON every framework row shares; ``dtype`` "fp32" leaves out the bf16 block."""
    precision = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            **precision,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
            "steps_per_print": 10**6, "zeroplus": {"log_level": "warning"}}


def plain_step(wrapped: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer):
    """One step of a torch-native wrapper (DDP, FSDP2): forward, backward, clipping to 1.0, AdamW."""
    def train_step(x: torch.Tensor) -> float:
        loss = wrapped(x, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return train_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["zeroplus", "deepspeed", "fsdp2", "ddp"], required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model", default="111m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (masters fp32 either way)")
    p.add_argument("--out-prefix", required=True)
    p.add_argument("--zeroplus", default="{}", help="JSON merged into the config's zeroplus block")
    p.add_argument("--zero", default="{}", help="JSON merged into the config's zero_optimization block")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="activation checkpointing of every block (zeroplus's or DeepSpeed's checkpoint)")
    args = p.parse_args()

    from zeroplus.models import GPT, gpt_config
    if args.framework == "deepspeed":
        import deepspeed
    import zeroplus
    rank, start_rss = start_measuring()

    model = GPT(gpt_config(args.model, block_size=max(64, args.seq), checkpoint_blocks=args.checkpoint_blocks))
    cfg = ds_config(args.stage, args.micro_batch, args.dtype)
    cfg["zeroplus"].update(json.loads(args.zeroplus))
    cfg["zero_optimization"].update(json.loads(args.zero))
    if args.checkpoint_blocks and args.framework == "deepspeed":
        import zeroplus.models.gpt as gpt_module
        gpt_module.checkpoint = deepspeed.checkpointing.checkpoint
    if args.framework == "zeroplus":
        engine = zeroplus.initialize(model, cfg)

        def train_step(x: torch.Tensor) -> float:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            return loss.item()
    elif args.framework == "deepspeed":
        cfg.pop("zeroplus")
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())

        def train_step(x: torch.Tensor) -> float:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            return loss.item()
    elif args.framework == "ddp":  # the reference: whole model, gradients all-reduced, plain AdamW
        if args.dtype != "fp32":
            raise SystemExit("the ddp row runs in fp32 only")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        train_step = plain_step(ddp, model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1))
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        low = torch.bfloat16 if args.dtype == "bf16" else None
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
        reshard = args.stage == 3
        for block in model.blocks:
            fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        except RuntimeError:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        train_step = plain_step(model, model, opt)

    g = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for _ in range(args.steps):
        x = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq), generator=g)
        t0 = time.perf_counter()
        losses.append(train_step(x))
        times.append(time.perf_counter() - t0)
    peak = rss_bytes("VmHWM") - start_rss
    ledger = {}
    if args.framework == "zeroplus":
        from zeroplus.ledger import Category
        ledger = {c.value: [engine.ledger.live_bytes(c), engine.ledger.peak_bytes(c)] for c in Category}
    with open(f"{args.out_prefix}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak_above_start_bytes": peak, "step_seconds": times, "losses": losses,
                   "params": sum(p.numel() for p in model.parameters()), "ledger_live_peak": ledger}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (DeepSpeed aborts in it on CPU)


if __name__ == "__main__":
    main()
