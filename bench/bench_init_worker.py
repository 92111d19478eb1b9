"""One rank of an initialisation benchmark (launched by ``bench_init.py`` under torchrun): builds the model
one way, hands it to zeroplus, DeepSpeed or FSDP2, and writes the peak resident memory above the process
before the model existed, through ``initialize`` (and the pretrained load), with the shard of the model
states the rank ends with."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.hf_models
from bench_worker import rss_bytes, start_measuring  # noqa: E402

from tests.hf_models import build  # noqa: E402
from zeroplus.models import GPT, gpt_config  # noqa: E402


def make(model: str) -> torch.nn.Module:
    return GPT(gpt_config("111m")) if model == "gpt-111m" else build("llama", "small")


def config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**6,
            "zeroplus": {"memory_estimate": False, "log_level": "warning"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["zeroplus", "deepspeed", "fsdp2"], required=True)
    p.add_argument("--path", choices=["normal", "init", "meta", "pretrained"], required=True)
    p.add_argument("--model", choices=["gpt-111m", "llama-small"], required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--pretrained", help="checkpoint directory for --path pretrained")
    p.add_argument("--out-prefix", required=True)
    args = p.parse_args()
    if args.framework == "deepspeed":
        import deepspeed
    import zeroplus
    rank, start = start_measuring()
    cfg = config(args.stage)
    states = unit = 0
    if args.framework == "zeroplus":
        if args.path == "init":
            with zeroplus.Init(config_dict_or_path=cfg):
                model = make(args.model)
        elif args.path in ("meta", "pretrained"):
            with torch.device("meta"):
                model = make(args.model)
        else:
            model = make(args.model)
        meta_gpt = args.model == "gpt-111m" and args.path in ("meta", "pretrained")
        engine = zeroplus.initialize(model, cfg, init_fn=GPT._init if meta_gpt else None)  # GPT's apply(_init)
        if args.path == "pretrained":
            engine.load_pretrained(args.pretrained)
        states = engine.ledger.live_bytes()
        unit = max(u.numel for u in engine.partition.units) * 4  # one unit gathered, fp32
    elif args.framework == "deepspeed":
        cfg.pop("zeroplus")
        if args.path == "init":
            with deepspeed.zero.Init(config_dict_or_path=cfg):
                model = make(args.model)
        else:
            model = make(args.model)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    else:
        from torch.distributed.fsdp import fully_shard
        if args.path == "meta":
            with torch.device("meta"):
                model = make(args.model)
        else:
            model = make(args.model)
        blocks = model.blocks if args.model == "gpt-111m" else model.model.layers
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        if args.path == "meta":
            model.to_empty(device="cpu")
            with torch.no_grad():
                if args.model == "gpt-111m":
                    model.apply(GPT._init)
                else:
                    model.initialize_weights()
        torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = rss_bytes("VmHWM") - start
    with open(f"{args.out_prefix}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak_above_start_bytes": peak, "model_states_bytes": states, "unit_bytes": unit}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
