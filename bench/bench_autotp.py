"""Benchmark: Hugging Face models split by their own plans (AutoTP, AutoEP) at 4 ranks, per-rank memory and step time.

Rows, each a torchrun launch of 4 gloo ranks (one thread each), fp32, AdamW, gradient clipping 1.0, micro-batch 1 x
``--seq`` tokens, the per-rank peak resident memory above the process just before the model is built (max over
ranks), the median step time of the steps after the first two:

- ``zeroplus-autotp``: a Llama of about 100M parameters (hidden 768, 8 layers, 12 query and 4 key/value heads,
  intermediate 2048, vocabulary 32000, untied) at ``"tensor_parallel": {"autotp_size": 2}`` (tensor 2 x data 2),
  ZeRO-1 over the data pairs;
- ``deepspeed-autotp``: the same JSON on DeepSpeed (``DS_ACCELERATOR=cpu``, ``torch_adam``): its AutoTP from the
  model's plan (it keeps the input embeddings whole, zeroplus splits them by vocabulary);
- ``zeroplus-zero3``: the same Llama at ZeRO-3 over the 4 data ranks;
- ``zeroplus-autoep``: a Mixtral-shaped model (hidden 512, 4 layers, 8 experts of intermediate 1024, top-2,
  vocabulary 32000) at ``"expert_parallel": {"enabled": true, "autoep_size": 4}``, ZeRO-1 (each rank 2 experts
  of every layer; the rest replicated, its states over the 4 data ranks);
- ``zeroplus-moe-zero3``: the same Mixtral-shaped model at ZeRO-3 over the 4 data ranks.

The tensor ranks of a pair see the same batch (seeded by the data rank), the data ranks each their own.

    python bench/bench_autotp.py                       # every row, 1 round (~5 minutes on 2 cores)
    python bench/bench_autotp.py --rows zeroplus-autotp,deepspeed-autotp --rounds 3 --steps 6

What 2 cores can show: 4 ranks share them, so step times say which layout moves more and computes more per rank,
not what a GPU node would time; the memory is each rank's own and does not depend on the cores.
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
from typing import Any

from bench_worker import rank_results

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
ROWS = ("zeroplus-autotp", "deepspeed-autotp", "zeroplus-zero3", "zeroplus-autoep", "zeroplus-moe-zero3")
VOCAB = 32000


def model(row: str) -> Any:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    if "moe" in row or "autoep" in row:
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=1024))


def config(row: str, micro: int) -> dict:
    stage = 3 if row.endswith("zero3") else 1
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                           "zero_optimization": {"stage": stage}}
    if "autotp" in row:
        cfg["tensor_parallel"] = {"autotp_size": 2}
    if row == "zeroplus-autoep":
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": 4}
    if row.startswith("deepspeed"):
        cfg["optimizer"]["params"]["torch_adam"] = True
        cfg["train_batch_size"] = micro * 4  # (DeepSpeed counts every rank, tensor ranks too)
    else:
        cfg["zeroplus"] = {"log_level": "warning"}
    return cfg


def worker(row: str, steps: int, out: str, micro: int, seq: int) -> None:
    import torch
    import torch.distributed as dist
    from bench_worker import rss_bytes, start_measuring

    if row.startswith("deepspeed"):
        import deepspeed
    else:
        import zeroplus

    rank, start = start_measuring()  # (the gloo group joined, VmHWM from here)
    net, cfg = model(row), config(row, micro)
    if row.startswith("deepspeed"):
        engine, *_ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
    else:
        zeroplus.init_parallel(cfg)
        engine = zeroplus.initialize(net, cfg)
    data_rank = rank // 2 if "autotp" in row else rank
    g = torch.Generator().manual_seed(data_rank)
    times, losses = [], []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (micro, seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    q = engine.module.model.layers[0].self_attn.q_proj.weight
    shape = list(getattr(q, "ds_shape", q.shape)) if row.startswith("deepspeed") else list(q.shape)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"peak": rss_bytes("VmHWM") - start, "times": times, "losses": losses, "q_proj": shape}, f)
    dist.barrier()
    os._exit(0)  # (DeepSpeed aborts in interpreter teardown on CPU)


def launch(row: str, steps: int, micro: int, seq: int, trim: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
        env.update(MALLOC_ENV if trim else {}, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", ZEROPLUS_ACCELERATOR="cpu")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               os.path.abspath(__file__), "--worker", row, "--steps", str(steps), "--out", out,
               "--micro-batch", str(micro), "--seq", str(seq)]
        ranks = rank_results(out, 4, row, subprocess.run(cmd, env=env, capture_output=True, text=True))
    warm = ranks[0]["times"][2:] or ranks[0]["times"]
    return {"peak": max(r["peak"] for r in ranks), "step": statistics.median(warm), "loss": ranks[0]["losses"][-1],
            "q_proj": ranks[0]["q_proj"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--glibc-as-left", action="store_true", help="no MALLOC_* settings (a user's default)")
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.micro_batch, args.seq)
        return
    rows = args.rows.split(",")
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    for _ in range(args.rounds):
        for row in rows:  # interleaved rounds
            runs[row].append(launch(row, args.steps, args.micro_batch, args.seq, not args.glibc_as_left))
    print(f"micro-batch {args.micro_batch} x {args.seq}, fp32, 4 ranks, {args.rounds} round(s), glibc "
          f"{'as left' if args.glibc_as_left else 'returning freed memory'}; medians of the rounds")
    print("| row | peak MiB per rank | step s | last loss | q_proj on rank 0 |\n|---|---|---|---|---|")
    for row in rows:
        peak = statistics.median(r["peak"] for r in runs[row]) / 2**20
        step = statistics.median(r["step"] for r in runs[row])
        print(f"| {row} | {peak:.0f} | {step:.2f} | {runs[row][-1]['loss']:.4f} | {runs[row][-1]['q_proj']} |")


if __name__ == "__main__":
    main()
