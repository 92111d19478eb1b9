"""Benchmark: ZeRO-3 memory as a user's own script measures it, zeroplus against FSDP2 and DeepSpeed.

A user's harness, rebuilt from their description: a GPT a user writes (``nn.Linear``, ``LayerNorm``,
PyTorch's SDPA, ``F.cross_entropy``; 12 layers, d 768, vocabulary 16384, head untied: 111M parameters),
2 gloo ranks, micro-batch 1, sequence 64, glibc returning freed memory, the per-rank peak resident
memory above the process just before the model is built. Unlike ``bench_zero.py`` (zeroplus's own GPT;
zeroplus imported by every row), each row's process imports only its own framework, before the
measured start, as a user's script does; whatever that framework imports later (torch imports
``torch._dynamo``, 70 MiB resident here, when the first optimizer is built; ``import zeroplus`` does it
up front, see note: runtime baseline) is in its peak.

Rows: ``zeroplus`` (the JSON below, zeroplus's defaults for what it leaves out); ``zeroplus-ds-defaults``
(the same JSON with DeepSpeed's documented defaults written out: ``stage3_prefetch_bucket_size`` 5e7,
``stage3_param_persistence_threshold`` 1e5, ``reduce_bucket_size`` 5e8, ...; zeroplus honours them);
``zeroplus-no-recompute`` (plus ``"resize_recompute": {"enabled": false}``: the defaults before
2026-11-27; on by default since, the GELU and LayerNorm outputs are recomputed in backward, bitwise the same
gradients: see note: recompute by default; since 2026-11-27 only where it takes at least 1% off the predicted
peak, so at 1 x 64 this row and ``zeroplus`` run alike: see note: recompute where it pays);
``zeroplus-torch-loss`` (plus ``"lean_cross_entropy": false``: torch's own cross-entropy, the defaults before
2026-11-27, see note: lean loss); ``zeroplus-units`` (plus ``"unit_modules": ["Block", "Embedding"]``: the
embeddings leave the root unit);
``fsdp2`` (``fully_shard`` per block and root, default ``reshard_after_forward``, bf16:
``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)``, ``torch.optim.AdamW`` with default arguments,
``clip_grad_norm_``, ``zero_grad(set_to_none=True)``); ``deepspeed`` (the JSON, ``DS_ACCELERATOR=cpu``).
Each row runs ``--rounds`` times, interleaved; the table gives the median peak (max over ranks) and
the median step time of those launches (under the trimming allocator: for memory, not for speed).

    python bench/bench_harness.py                                 # fp32 and bf16, 3 rounds (~15 minutes)
    python bench/bench_harness.py --dtypes fp32 --rows zeroplus,fsdp2 --rounds 1
    python bench/bench_harness.py --micro-batch 4 --seq 256        # the activation regime, same model
    python bench/bench_harness.py --classes own --dtypes fp32 --rows zeroplus,fsdp2   # the GPT with its own classes
    python bench/bench_harness.py --timing --dtypes bf16 --rows zeroplus,zeroplus-no-recompute   # step times
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
DS_DEFAULTS = {"stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
               "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "stage3_max_live_parameters": 1e9,
               "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9}
ROWS = ("zeroplus", "zeroplus-ds-defaults", "zeroplus-no-recompute", "zeroplus-torch-loss", "zeroplus-units", "fsdp2",
        "deepspeed")
# the zeroplus rows' own keys: resize recompute off (the defaults before 2026-11-27), and the input embeddings as
# units of their own (gathered for their forward and backward only, not the whole step)
ZEROPLUS_KEYS = {"zeroplus": {}, "zeroplus-ds-defaults": {},
                 "zeroplus-no-recompute": {"resize_recompute": {"enabled": False}},
                 "zeroplus-torch-loss": {"lean_cross_entropy": False},
                 "zeroplus-units": {"unit_modules": ["Block", "Embedding"]}}


def config(dtype: str, ds_defaults: bool) -> dict:
    """The JSON every config-driven row reads."""
    zero: dict = {"stage": 3, **(DS_DEFAULTS if ds_defaults else {})}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": zero, "steps_per_print": 10**6}


SIZES = {"111m": (16384, 768, 12, 12), "test": (8192, 512, 4, 8)}  # vocabulary, width, layers, heads


def user_gpt(classes: str = "nn", seq: int = 64, size: str = "111m") -> Any:
    """The user's GPT (``size`` 111m: 12 layers, d 768, vocabulary 16384, head untied: 111M parameters; ``test``:
    21M, for the suite). ``classes``: "nn" builds
    it from ``torch.nn``'s layers, "own" from its own ``Linear``, ``LayerNorm`` and ``Embedding`` classes
    (``tests/models.py``'s ``Plain*``: each reads its ``self.weight`` in its forward, ``x @ w.t() + b``, the
    normalisation written out, ``self.weight[idx]``), as many model codebases do."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.models import PlainEmbedding as OwnEmbedding  # (torch only: the measured start is still ahead)
    from tests.models import PlainLayerNorm as OwnLayerNorm
    from tests.models import PlainLinear as OwnLinear

    Linear, LayerNorm, Embedding = ((OwnLinear, OwnLayerNorm, OwnEmbedding) if classes == "own"
                                    else (nn.Linear, nn.LayerNorm, nn.Embedding))

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = LayerNorm(d), LayerNorm(d)
            self.qkv, self.proj = Linear(d, 3 * d), Linear(d, d)
            self.fc, self.fc2 = Linear(d, 4 * d), Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (u.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                       for u in self.qkv(self.ln1(x)).split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc(self.ln2(x))))

    class UserGPT(nn.Module):
        def __init__(self, vocab: int = 16384, d: int = 768, layers: int = 12, heads: int = 12, seq: int = 64):
            super().__init__()
            self.wte, self.wpe = Embedding(vocab, d), Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln_f, self.head = LayerNorm(d), Linear(d, vocab, bias=False)

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    vocab, d, layers, heads = SIZES[size]
    return UserGPT(vocab, d, layers, heads, seq)


def fsdp2_step(model: Any, blocks: Any, bf16: bool, loss: Any) -> Any:
    """FSDP2 in its best honest configuration for these rows: ``fully_shard`` per block and root,
    ``reshard_after_forward`` default, bf16 as ``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)``,
    ``torch.optim.AdamW``, ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``; returns one step of
    ``loss(model, x)`` as a function of the batch."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor) -> float:
        value = loss(model, x)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value.item()
    return step


def worker(row: str, dtype: str, steps: int, out: str, micro: int = 1, seq: int = 64, classes: str = "nn") -> None:
    """One rank of one row: imports, the measured start, the user's model (``user_gpt(classes)``), ``steps``
    steps."""
    import torch
    import torch.distributed as dist

    if row == "deepspeed":
        import deepspeed
    elif row.startswith("zeroplus"):
        import zeroplus
    else:
        import torch.distributed.fsdp  # noqa: F401 - before the measured start, as the other rows import theirs

    def resident(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    start = resident("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    model = user_gpt(classes, seq)
    cfg = config(dtype, row == "zeroplus-ds-defaults")
    cfg["train_micro_batch_size_per_gpu"] = micro
    if row == "fsdp2":
        step = fsdp2_step(model, model.blocks, dtype == "bf16", lambda m, x: m(x, x))
    else:
        if row == "deepspeed":
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        else:
            cfg["zeroplus"] = {"log_level": "warning", **ZEROPLUS_KEYS[row]}
            engine = zeroplus.initialize(model, cfg)

        def step(x: torch.Tensor) -> float:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            return loss.item()
    g = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for _ in range(steps):
        x = torch.randint(0, 16384, (micro, seq), generator=g)
        t0 = time.perf_counter()
        losses.append(step(x))
        times.append(time.perf_counter() - t0)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"peak": resident("VmHWM") - start, "times": times, "losses": losses}, f)
    dist.barrier()
    os._exit(0)  # (DeepSpeed aborts in interpreter teardown on CPU)


def launch(row: str, dtype: str, steps: int, micro: int = 1, seq: int = 64, trim: bool = True,
           classes: str = "nn") -> dict:
    """One launch of ``row``; ``trim`` False: glibc keeps freed memory (for step times, not peaks)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
        env.update(MALLOC_ENV if trim else {}, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", ZEROPLUS_ACCELERATOR="cpu")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.abspath(__file__), "--worker", row, "--dtypes", dtype, "--steps", str(steps), "--out", out,
               "--micro-batch", str(micro), "--seq", str(seq), "--classes", classes]
        ranks = rank_results(out, 2, f"{row} {dtype}", subprocess.run(cmd, env=env, capture_output=True, text=True))
    warm = ranks[0]["times"][2:] or ranks[0]["times"]
    return {"peak": max(r["peak"] for r in ranks), "step": statistics.median(warm), "loss": ranks[0]["losses"][-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--timing", action="store_true", help="launch without the trimming allocator: step times "
                   "to compare (the peaks then include what glibc keeps)")
    p.add_argument("--classes", choices=("nn", "own"), default="nn", help="the GPT from torch.nn's layers, or from "
                   "the script's own Linear, LayerNorm and Embedding classes")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.dtypes, args.steps, args.out, args.micro_batch, args.seq, args.classes)
        return
    rows, dtypes = args.rows.split(","), args.dtypes.split(",")
    unknown = set(rows) - set(ROWS)
    if unknown:
        raise SystemExit(f"--rows: unknown {sorted(unknown)}; choose from {list(ROWS)}")
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for dtype in dtypes:
            for row in rows:
                results.setdefault((row, dtype), []).append(launch(row, dtype, args.steps, args.micro_batch,
                                                                   args.seq, not args.timing, args.classes))
    layers = "its own" if args.classes == "own" else "torch.nn"
    print(f"ZeRO-3, user GPT 111M ({layers} layer classes), 2 gloo ranks, {args.micro_batch} x {args.seq}, "
          f"{args.steps} steps, "
          f"median of {args.rounds} launches{', glibc keeping freed memory' if args.timing else ''}")
    trimming = "" if args.timing else " (trimming allocator)"
    print(f"| row | dtype | peak MiB/rank (launches) | / FSDP2 | step s{trimming} | last loss |")
    print("|---|---|---|---|---|---|")
    for dtype in dtypes:
        fsdp = results.get(("fsdp2", dtype))
        base = statistics.median(r["peak"] for r in fsdp) if fsdp else None
        for row in rows:
            rs = results[(row, dtype)]
            peak = statistics.median(r["peak"] for r in rs)
            ratio = f"{peak / base:.2f}" if base else "-"
            each = ", ".join(f"{r['peak'] / 2**20:.0f}" for r in rs)
            print(f"| {row} | {dtype} | {peak / 2**20:.0f} ({each}) | {ratio} | "
                  f"{statistics.median(r['step'] for r in rs):.2f} | {rs[-1]['loss']:.4f} |")


if __name__ == "__main__":
    main()
