"""Long sequences: activation peak per rank against sequence length, without and with context
parallelism (Ulysses, ring, and at C >= 4 hybrid: Ulysses over pairs, a ring across them) and tiled MLP and
loss; and the longest sequence that fits a budget.

    python bench/bench_context.py [--seqs 1024,2048,4096] [--tiled-seqs 16384] [--contexts 2,4] [--vocab 32000]
                                  [--loss-tokens 512] [--mlp-tokens 512] [--budget-mib 128,512]

Each row is one launch (torchrun, gloo, one thread per rank; C ranks = data 1 x context C; C = 1
is a single process without context parallelism): the built-in GPT "small" (4 layers, d 128, 4 heads;
learned positions: a table of ``--seq`` rows whose gradient every rank holds whole, so it grows with
the sequence and does not divide by C) or, ``--model llama``, a Hugging Face Llama of that size
(rotary positions; 4 x d gated MLP) built from its config, with a ``--vocab`` vocabulary, ZeRO-1
in fp32, micro-batch 1, two micro-batches per step, one warm-up step, then one measured step. The
activation peak is the process's resident peak during the forward and backward of the step's second
micro-batch above its resident memory just before it, with glibc returning freed memory
(``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``), the largest over the ranks: the model states,
gradient buffers included (made by the first micro-batch, accumulated into by the second), are
resident then, so the peak is what the activations and the compute's temporaries add. The first
micro-batch's peak, which also makes the gradient buffers, is printed apart. Target:
at C ranks at most 1.15 / C of the single-process peak at the same total sequence; the tiled
loss removes the vocabulary-sized logits (``4 * s * V`` bytes and their gradient) from the peak.
Also printed: the part of the peak that grows with the sequence (MiB per 1024 tokens between the two
longest lengths run), whose ratio to the single process's leaves out what every rank holds whatever
the length (one block of the loss's logits, ``4 t V``), which no split of the sequence can divide. The
headline: the longest sequence length of those run whose activation peak fits ``--budget-mib`` per
rank (one column per budget), for each setting. ``--tiled-seqs``: longer lengths run with tiling only (untiled, the
logits alone would take ``4 s V`` bytes several times over).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from bench_worker import rss_bytes as rss

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(args: argparse.Namespace) -> None:
    import zeroplus
    from zeroplus.models import GPT, gpt_config

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_num_threads(1)
    zp: dict = {"log_level": "warning", "memory_estimate": False}
    if args.context > 1:
        zp["parallel"] = {"context": args.context, "context_mode": args.mode,
                          **({"ulysses_size": 2} if args.mode == "hybrid" else {})}
    if args.tiled:
        zp["tiled"] = {"mlp_tokens": args.mlp_tokens, "loss_tokens": args.loss_tokens}
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 1}, "zeroplus": zp}
    torch.manual_seed(0)
    if args.model == "llama":
        import transformers
        llama = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=128, intermediate_size=512,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=args.seq, attn_implementation="sdpa")
        engine = zeroplus.initialize(transformers.LlamaForCausalLM(llama), cfg)
    else:
        engine = zeroplus.initialize(GPT(gpt_config("small", vocab_size=args.vocab, block_size=args.seq)), cfg)
    x = torch.randint(0, args.vocab, (1, args.seq))

    def loss() -> torch.Tensor:
        return engine(input_ids=x, labels=x).loss if args.model == "llama" else engine(x, x)
    for _ in range(2):  # the warm-up step
        engine.backward(loss())
        engine.step()
    peaks = []
    for _ in range(2):  # the measured step: its first micro-batch makes the gradient buffers, the second finds them
        if dist.is_initialized():
            dist.barrier()
        before = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        engine.backward(loss())
        peaks.append(rss("VmHWM") - before)
        engine.step()
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump({"activation_peak": peaks[1], "with_gradient_buffers": peaks[0]}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(seq: int, context: int, mode: str, tiled: bool, vocab: int, tiles: tuple[int, int] = (512, 512),
           model: str = "gpt") -> tuple[int, int]:
    """``(activation peak, peak of a micro-batch that makes the gradient buffers)``, bytes, the largest over
    the ranks."""
    env = dict(os.environ, ZEROPLUS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072",
               MALLOC_TRIM_THRESHOLD_="131072", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        args = [__file__, "--worker", "--seq", str(seq), "--context", str(context), "--mode", mode, "--vocab",
                str(vocab), "--out", out, "--mlp-tokens", str(tiles[0]), "--loss-tokens", str(tiles[1]),
                "--model", model] + (["--tiled"] if tiled else [])
        cmd = ([sys.executable] + args if context == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(context)] + args)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        ranks = [json.load(open(f"{out}.{r}.json")) for r in range(context)]
        return max(r["activation_peak"] for r in ranks), max(r["with_gradient_buffers"] for r in ranks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="ulysses", help=argparse.SUPPRESS)
    p.add_argument("--tiled", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                   help="gpt: zeroplus's GPT small (learned positions, a table of --seq rows); llama: a Hugging "
                        "Face Llama of the same size (rotary positions, untied head), built from its config")
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--tiled-seqs", default="", help="longer lengths run with tiling only")
    p.add_argument("--mlp-tokens", type=int, default=512, help="tokens per MLP tile")
    p.add_argument("--loss-tokens", type=int, default=512, help="tokens per loss tile")
    p.add_argument("--contexts", default="2,4")
    p.add_argument("--budget-mib", default="128,512", help="per-rank budgets (MiB) of the headline, comma-separated")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    seqs = [int(s) for s in args.seqs.split(",") if s]
    tiled_only = [int(s) for s in args.tiled_seqs.split(",") if s]
    tiles = (args.mlp_tokens, args.loss_tokens)
    settings = [("no context parallelism", 1, "ulysses")]
    for c in (int(c) for c in args.contexts.split(",")):
        settings += [(f"Ulysses C={c}", c, "ulysses"), (f"ring C={c}", c, "ring")]
        if c >= 4 and c % 2 == 0:  # Ulysses over pairs, a ring of C / 2 across them
            settings.append((f"hybrid 2 x {c // 2} C={c}", c, "hybrid"))
    title = "GPT small" if args.model == "gpt" else "Llama (GPT small's size)"
    print(f"activation peak per rank (MiB), {title}, vocabulary {args.vocab}, fp32, micro-batch 1; "
          f"ratio: against the single process at the same sequence, target 1.15 / C; tiles: MLP {tiles[0]}, "
          f"loss {tiles[1]} tokens")
    header = f"{'setting':<28}{'tiled':>6}" + "".join(f"{s:>16}" for s in seqs + tiled_only)
    print(header)
    base: dict[tuple[bool, int], int] = {}
    budgets = [float(b) for b in args.budget_mib.split(",")]
    fits: dict[tuple[str, float], int] = {}
    peaks: dict[tuple[str, bool], dict[int, int]] = {}
    making: dict[tuple[str, bool], dict[int, int]] = {}  # the second table
    for name, c, mode in settings:
        for tiled in (False, True):
            cells = []
            for s in seqs + tiled_only:
                if not tiled and s in tiled_only:
                    cells.append("-")
                    continue
                peak, made = launch(s, c, mode, tiled, args.vocab, tiles, args.model)
                making.setdefault((name, tiled), {})[s] = made
                peaks.setdefault((name, tiled), {})[s] = peak
                if c == 1:
                    base[(tiled, s)] = peak
                ratio = peak / base[(tiled, s)] if (tiled, s) in base else float("nan")
                cells.append(f"{peak / 2**20:8.0f} ({ratio:4.2f})")
                for budget in budgets:
                    if peak <= budget * 2**20:
                        key = (f"{name}{', tiled' if tiled else ''}", budget)
                        fits[key] = max(fits.get(key, 0), s)
            print(f"{name:<28}{'yes' if tiled else 'no':>6}" + "".join(f"{cell:>16}" for cell in cells), flush=True)
    print("\nthe part of the peak that grows with the sequence: MiB per 1024 tokens between the two longest "
          "lengths run (a per-rank constant, such as one block of the loss's logits, drops out); "
          "ratio against the single process, target 1.15 / C:")
    for tiled in (False, True):
        slopes: dict[str, float] = {}
        for name, c, _ in settings:
            got = sorted(peaks.get((name, tiled), {}).items())
            if len(got) < 2:
                continue
            (s0, p0), (s1, p1) = got[-2:]
            slopes[name] = (p1 - p0) / (s1 - s0) * 1024 / 2**20
            one = slopes.get(settings[0][0])
            ratio = f"({slopes[name] / one:4.2f})" if one else ""
            print(f"  {name + (', tiled' if tiled else ''):<36}{slopes[name]:8.2f} {ratio}  [{s0} -> {s1} tokens]")
    print("\nthe same runs' first micro-batch of the step, which also makes the gradient buffers (MiB per rank; "
          "at ZeRO-1 every rank's are whole, the same with and without context parallelism):")
    print(header)
    for (name, tiled), made in making.items():
        cells = [f"{made[s] / 2**20:8.0f}" if s in made else "-" for s in seqs + tiled_only]
        print(f"{name:<28}{'yes' if tiled else 'no':>6}" + "".join(f"{cell:>16}" for cell in cells))
    print("\nlongest sequence run whose activation peak fits the budget per rank (tokens; 0: none of the lengths "
          "run fits; a setting with no length run is left out):")
    print(f"  {'setting':<36}" + "".join(f"{f'{b:.0f} MiB':>12}" for b in budgets))
    for name, tiled in peaks:
        key = f"{name}{', tiled' if tiled else ''}"
        print(f"  {key:<36}" + "".join(f"{fits.get((key, b), 0):>12}" for b in budgets))


if __name__ == "__main__":
    main()
