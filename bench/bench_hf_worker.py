"""One rank of a Hugging Face model, or zeroplus's GPT (``--family gpt``), trained by zeroplus (launched by
``bench_hf_budget.py`` under torchrun): writes its measured peak beside the engine's own first-forward
prediction, on two bases: the engine report's (resident memory above the process when ``initialize``
started, the model's tensors counted: what the budget predicts and the log prints) and the process's
before the model existed."""
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", required=True)
    p.add_argument("--size", default="small")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--mask", action="store_true", help="pass an attention mask")
    p.add_argument("--zeroplus", default="{}", help="JSON merged into the config's zeroplus block")
    p.add_argument("--out-prefix", required=True)
    p.add_argument("--import-first", action="store_true",
                   help="import the model's Transformers classes before the measured start (as scripts do)")
    p.add_argument("--train-first", action="store_true",
                   help="train a tiny copy of the family one step before the measured start (as a script that "
                        "evaluated or trained something first)")
    args = p.parse_args()

    import zeroplus
    gpt = args.family == "gpt"
    if args.import_first and not gpt:  # the family's modeling module, as `from transformers import X` would
        build(args.family, "tiny")
    if args.train_first:
        earlier = GPT(gpt_config("tiny")) if gpt else build(args.family, "tiny")
        ids = torch.randint(0, 200, (2, 32))
        (earlier(ids, ids) if gpt else earlier(input_ids=ids, labels=ids).loss).backward()
        torch.optim.AdamW(earlier.parameters()).step()
        del earlier
    rank, start_rss = start_measuring()
    model = (GPT(gpt_config(args.size, block_size=max(64, args.seq))) if gpt
             else build(args.family, args.size, args.attn))
    vocab = gpt_config(args.size).vocab_size if gpt else model.config.vocab_size
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}},
           "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": args.bf16},
           "zeroplus": json.loads(args.zeroplus)}
    model_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    engine = zeroplus.initialize(model, cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g)
        kwargs = {"attention_mask": torch.ones_like(ids)} if args.mask else {}
        loss = engine(ids, ids) if gpt else engine(input_ids=ids, labels=ids, **kwargs).loss
        engine.backward(loss)
        engine.step()
    peak = rss_bytes("VmHWM") - start_rss
    budget = engine.budget
    with open(f"{args.out_prefix}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak_above_start_bytes": peak,
                   "predicted": budget.training_peak_bytes if budget is not None else None,
                   "phase": budget.training_peak_phase if budget is not None else None,
                   "model_bytes": model_bytes, "phases": budget.phases if budget is not None else None,
                   "engine_measured": engine.memory_report().process_peak_above_start_bytes,
                   "baseline": engine.memory_report().baseline_bytes,
                   "saved": engine.memory_report().saved,
                   "technique_effects": engine.memory_report().technique_effects}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
