"""One benchmark run on one rank (launched by ``bench_zero.py`` through torchrun).

Builds the GPT, wraps it with zeroplus, DeepSpeed or FSDP2, trains ``--steps`` steps of random
tokens, and writes ``{"peak_above_start_bytes", "step_seconds": [...], ...}`` to
``--out-prefix.RANK.json``. "Start" is this process's resident memory after imports and process
group set-up, before the model exists; the peak is VmHWM (reset at that point).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class LaunchFailed(RuntimeError):
    """A launch with a rank that wrote no result; ``first_error``: the first line of its output naming an Error
    (or its stderr's tail), for a table that records the failure and goes on."""

    def __init__(self, what: str, proc: subprocess.CompletedProcess) -> None:
        super().__init__(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
        self.first_error = (errors[0] if errors else proc.stderr[-500:]).strip()


def rank_results(out: str, ranks: int, what: str, proc: subprocess.CompletedProcess) -> list[dict]:
    """Each rank's ``{out}.{rank}.json`` after a launch (``proc``: its completed process); a rank that wrote none
    raises ``LaunchFailed`` with the launch's output tail."""
    results = []
    for rank in range(ranks):
        try:
            with open(f"{out}.{rank}.json") as f:
                results.append(json.load(f))
        except FileNotFoundError:
            raise LaunchFailed(what, proc) from None
    return results


def torchrun(script: str, args: list[str], ranks: int, what: str) -> list[dict]:
    """``script`` launched by torchrun on ``ranks`` local gloo ranks (one thread each) with ``args`` and ``--out
    PREFIX``; each rank's ``{PREFIX}.{rank}.json`` (``rank_results``: ``LaunchFailed`` where a rank wrote none)."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "rank")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", script,
               *args, "--out", prefix]
        env = dict(os.environ, OMP_NUM_THREADS="1", ZEROPLUS_ACCELERATOR="cpu", DS_ACCELERATOR="cpu")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        return rank_results(prefix, ranks, what, proc)


def start_measuring() -> tuple[int, int]:
    """Join the gloo group, seed, and start the peak count here: (rank, resident bytes now); the peak
    above it is read later as ``rss_bytes("VmHWM") - start``."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    start = rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    return dist.get_rank(), start


class Meter:
    """Where the run computes and how its peak is read. ``cpu``: gloo, the process's resident peak above
    the start (VmHWM). ``cuda``/``npu``: NCCL/HCCL, one device per local rank, the device allocator's peak
    above what it held at the start (``max_memory_allocated``), steps timed after a synchronize."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        if device == "cpu":
            self.rank, self.start = start_measuring()
            return
        if device == "npu":
            import torch_npu  # noqa: F401  (registers the device)
        self.module = getattr(torch, device)
        self.module.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.device = torch.device(device, self.module.current_device())
        dist.init_process_group("nccl" if device == "cuda" else "hccl")
        torch.manual_seed(0)
        self.module.reset_peak_memory_stats()
        self.rank, self.start = dist.get_rank(), self.module.memory_allocated()

    def synchronize(self) -> None:
        if self.device.type != "cpu":
            self.module.synchronize()

    def peak_above_start(self) -> int:
        if self.device.type == "cpu":
            return rss_bytes("VmHWM") - self.start
        return self.module.max_memory_allocated() - self.start


def _nbytes(t: torch.Tensor | list[torch.Tensor]) -> int:
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()


# Volume each rank hands to a collective, by the convention of the ZeRO paper's 2 Psi / 3 Psi: an
# all-reduce counts twice its buffer (a ring all-reduce is a reduce-scatter then an all-gather), an
# all-gather its output, a reduce-scatter its input, a broadcast, a reduce and an all-to-all their buffer.
# Collective -> (the argument measured, factor).
_VOLUME = {
    "all_reduce": ("tensor", 2), "all_gather_into_tensor": ("output_tensor", 1), "all_gather": ("tensor_list", 1),
    "all_gather_single": ("output_tensor", 1), "reduce_scatter_tensor": ("input", 1),
    "reduce_scatter_single": ("input", 1), "reduce_scatter": ("input_list", 1), "broadcast": ("tensor", 1),
    "reduce": ("tensor", 1),
    "all_to_all_single": ("input", 1),
    # None: N / (N - 1), a send's share of the reduce-scatter it serves (transports.PerRank.exchange)
    "isend": ("tensor", None),
}


class CollectiveVolume:
    """Counts the volume of every collective issued through ``torch.distributed``'s functions (installed
    before zeroplus, DeepSpeed or FSDP2 bind them; DDP's C++ reducer is counted through a comm hook
    calling the same ``all_reduce``)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        for name, (argument, factor) in _VOLUME.items():
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name), argument, factor))

    def _wrap(self, name, fn, argument, factor):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            measured = signature.bind(*args, **kwargs).arguments[argument]
            scale = factor if factor is not None else dist.get_world_size() / max(1, dist.get_world_size() - 1)
            self.bytes[name] = self.bytes.get(name, 0) + int(scale * _nbytes(measured))
            return fn(*args, **kwargs)
        return counted

    def count_swaps(self, pair_class: type) -> None:
        """Also count two gloo ranks' swaps through shared memory (``zeroplus/shm_pair.py``, ``SharedPair``), which
        bypass ``torch.distributed``: each stands in for one two-rank collective and counts as it would, twice the
        bytes it sends (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer counted twice)."""
        swap = pair_class.swap

        def counted(pair, send, recv, add=False):
            self.bytes["shm_pair"] = self.bytes.get("shm_pair", 0) + 2 * _nbytes(send)
            return swap(pair, send, recv, add)
        pair_class.swap = counted

    def take(self) -> dict[str, int]:
        """The volume since the last call, by collective."""
        out, self.bytes = self.bytes, {}
        return out


def ds_config(stage: int, micro_batch: int = 1, dtype: str = "bf16") -> dict:
    """The JSON every framework row shares; ``dtype`` "fp32" leaves out the bf16 block."""
    precision = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            **precision,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
            "steps_per_print": 10**6, "zeroplus": {"log_level": "warning"}}


def adamw(model: torch.nn.Module, kind: str = "fused") -> torch.optim.Optimizer:
    """torch's AdamW with its fused kernel where the device has one (CPU and CUDA do): the fastest
    plain reference, and the kernel zeroplus itself picks. ``kind`` "default": torch's defaults (on CPU
    the per-tensor loop, no fused or foreach temporaries), as a user writing ``AdamW(params)`` gets."""
    params = [p for p in model.parameters() if p.requires_grad]  # (a LoRA model: the adapters)
    if kind == "default":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    try:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)


def plain_step(wrapped: torch.nn.Module, model: torch.nn.Module, opt: torch.optim.Optimizer, hf: bool = False,
               autocast: torch.dtype | None = None):
    """One step of a torch-native wrapper (DDP, FSDP2): forward (under ``torch.autocast`` to ``autocast`` where
    given), backward, clipping to 1.0, AdamW; the loss."""
    device = next(model.parameters()).device.type

    def train_step(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=autocast) if autocast else contextlib.nullcontext():
            loss = lm_loss(wrapped, x, hf)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return train_step


ALLOCATIONS = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")
SYNCS = ("_local_scalar_dense", "is_nonzero", "item")  # a value read on the host: a device sync on a GPU
# An op whose output size depends on values reads a count back on an accelerator: a sync too.
SIZED = ("_unique", "_unique2", "unique_dim", "unique_consecutive", "nonzero", "masked_select")


def reads_on_host(func, args) -> bool:  # type: ignore[no-untyped-def]
    """Whether the aten op ``func`` called with ``args`` reads a value back on the host on an accelerator (a sync):
    a value read (``SYNCS``), an op sized by values (``SIZED``) or boolean indexing (``nonzero`` inside)."""
    name = func.__name__.split(".")[0]
    if name in SYNCS or name in SIZED:
        return True
    return name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])


FUNCTIONAL_BOOKKEEPING = ("wait_tensor", "_wrap_tensor_autograd")  # functional collectives' own ops: no launch


class StepCensus(TorchDispatchMode):
    """What one step asks of the device, counted at torch's dispatcher: the aten kernels it runs (views and
    allocations left out: no kernel on a GPU), the host syncs (a tensor's value read on the host: ``item()``,
    ``bool()``, and ops sized by values: ``unique``, ``nonzero``, boolean indexing; on CPU ``tolist()`` and
    ``.cpu()`` read memory without an op and are not seen), and the
    collective launches (the ``c10d`` ops and the functional collectives; the shared-memory pair's swaps are
    not ops: count on the native transport). A tensor subclass's op (FSDP2's DTensor) is counted as the ops it
    runs on its local tensors, collectives of its redistributions included (the clip norm's all-reduce).
    A GPU stand-in: on a GPU each kernel is a launch and each sync a stall."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = self.syncs = self.collectives = 0
        self.by_collective: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors):
            return NotImplemented  # a subclass (FSDP2's DTensor): count the ops it runs on its local tensors
        if tensors and all(t.is_meta for t in tensors):
            return func(*args, **(kwargs or {}))  # a subclass's sharding propagation: no kernel
        name = func.__name__.split(".")[0]
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional") and name not in FUNCTIONAL_BOOKKEEPING:
            self.collectives += 1
            self.by_collective[name] = self.by_collective.get(name, 0) + 1
        elif reads_on_host(func, args):
            self.syncs += 1
        elif not func.is_view and name not in ALLOCATIONS and namespace != "profiler":
            self.kernels += 1
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict:
        return {"kernels": self.kernels, "syncs": self.syncs, "collectives": self.collectives,
                "by_collective": self.by_collective}


HF_LLAMA = {"hf-llama": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=4, vocab_size=256),
            "hf-llama-125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                                  num_key_value_heads=4, vocab_size=32000)}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model(args: argparse.Namespace) -> tuple[torch.nn.Module, list[torch.nn.Module], int]:
    """(model, its blocks (what FSDP2 shards and compiles one by one), vocabulary size): zeroplus's GPT
    by size name, or ``hf-llama``: a Hugging Face ``LlamaForCausalLM`` of the GPT small's shape, built
    from its config (random weights, eager attention)."""
    if args.model in HF_LLAMA:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(**HF_LLAMA[args.model], max_position_embeddings=max(64, args.seq),
                          attn_implementation="eager", tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
        if args.checkpoint_blocks:
            model.gradient_checkpointing_enable()
        layers = list(model.model.layers)
        if args.lora:  # PEFT LoRA, rank 8 on every projection: the base frozen
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
        return model, layers, cfg.vocab_size
    from zeroplus.models import GPT, gpt_config
    shape = {"vocab_size": args.vocab} if args.vocab else {}
    model = GPT(gpt_config(args.model, block_size=max(64, args.seq), checkpoint_blocks=args.checkpoint_blocks,
                           tie_head=not args.untied, **shape))
    return model, list(model.blocks), model.config.vocab_size


def lm_loss(model: torch.nn.Module, x: torch.Tensor, hf: bool) -> torch.Tensor:
    """Next-token loss on ``x`` (the GPT takes targets; a Hugging Face model takes labels)."""
    return model(input_ids=x, labels=x).loss if hf else model(x, x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=["zeroplus", "deepspeed", "fsdp2", "ddp", "plain"], required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--model", default="111m")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (masters fp32 either way)")
    p.add_argument("--out-prefix", required=True)
    p.add_argument("--vocab", type=int, default=0, help="the built-in GPT's vocabulary (0: the size's own)")
    p.add_argument("--untied", action="store_true", help="the built-in GPT's LM head untied from its embedding")
    p.add_argument("--adamw", choices=["fused", "default"], default="fused",
                   help="FSDP2's optimizer: torch's fused AdamW, or AdamW with torch's defaults")
    p.add_argument("--reduce-fp32", action="store_true", help="FSDP2 in bf16: reduce gradients in fp32")
    p.add_argument("--zeroplus", default="{}", help="JSON merged into the config's zeroplus block")
    p.add_argument("--zero", default="{}", help="JSON merged into the config's zero_optimization block")
    p.add_argument("--bf16", default="{}", help="JSON merged into the config's bf16 block (bf16 runs)")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="activation checkpointing of every block (zeroplus's or DeepSpeed's checkpoint)")
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    p.add_argument("--lora", action="store_true", help="a Hugging Face model (--model hf-*) under PEFT LoRA")
    p.add_argument("--count-ops", action="store_true",
                   help="the last step under StepCensus: its kernels, host syncs and collective launches in the JSON")
    p.add_argument("--compile", action="store_true",
                   help="compile: engine.compile() (zeroplus, DeepSpeed); each block's compile() before fully_shard "
                        "(FSDP2, torchtitan's way); the first step's time includes the compilation")
    args = p.parse_args()

    volume = CollectiveVolume()
    if args.framework == "deepspeed":
        import deepspeed
    import zeroplus
    volume.count_swaps(zeroplus.shm_pair.SharedPair)
    meter = Meter(args.device)
    rank = meter.rank

    model, blocks, vocab = build_model(args)
    hf = args.model in HF_LLAMA
    model.to(meter.device)  # (zeroplus and DeepSpeed would move it; DDP and FSDP2 expect it there)
    n_params = sum(p.numel() for p in model.parameters())  # (DeepSpeed's ZeRO-3 leaves empty tensors behind)
    cfg = ds_config(args.stage, args.micro_batch, args.dtype)
    cfg["zeroplus"].update(json.loads(args.zeroplus))
    cfg["zero_optimization"].update(json.loads(args.zero))
    if "bf16" in cfg:
        cfg["bf16"].update(json.loads(args.bf16))
    if args.framework == "deepspeed" and cfg["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu":
        cfg["optimizer"]["params"].pop("torch_adam")  # DeepSpeed's CPU offload steps with its DeepSpeedCPUAdam
    if args.checkpoint_blocks and args.framework == "deepspeed":
        import zeroplus.models.gpt as gpt_module
        gpt_module.checkpoint = deepspeed.checkpointing.checkpoint
    if args.framework == "zeroplus":
        engine = zeroplus.initialize(model, cfg)
        if args.compile:
            engine.compile()

        def train_step(x: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(engine, x, hf)
            engine.backward(loss)
            engine.step()
            return loss
    elif args.framework == "deepspeed":
        cfg.pop("zeroplus")
        engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        if args.compile:
            engine.compile()

        def train_step(x: torch.Tensor) -> torch.Tensor:
            loss = lm_loss(engine, x, hf)
            engine.backward(loss)
            engine.step()
            return loss
    elif args.framework in ("ddp", "plain"):  # the references: whole model, plain AdamW (DDP: gradients all-reduced)
        # bf16: fp32 weights and optimizer under torch.autocast, as AMP and Hugging Face's Trainer (bf16=True) run it
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if args.framework == "ddp" else model
        if args.framework == "ddp":  # torch's own all-reduce hook, in Python: its all_reduce is counted
            wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        train_step = plain_step(wrapped, model, adamw(model), hf,
                                autocast=torch.bfloat16 if args.dtype == "bf16" else None)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        low = torch.bfloat16 if args.dtype == "bf16" else None
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if args.reduce_fp32 else low)
        reshard = args.stage == 3
        for block in blocks:
            if args.compile:
                block.compile()
            fully_shard(block, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
        train_step = plain_step(model, model, adamw(model, args.adamw), hf)

    g = torch.Generator().manual_seed(rank)
    times, losses, volumes = [], [], []
    census = StepCensus()
    volume.take()  # (set-up's broadcasts)
    for _ in range(args.steps):
        x = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(meter.device)
        meter.synchronize()
        t0 = time.perf_counter()
        if args.count_ops and len(times) == args.steps - 1:
            with census:
                loss = train_step(x)
        else:
            loss = train_step(x)
        losses.append(loss.item())  # (waits for the loss; the optimizer step may still run)
        meter.synchronize()
        times.append(time.perf_counter() - t0)
        volumes.append(volume.take())
    peak = meter.peak_above_start()
    ledger = {}
    if args.framework == "zeroplus":
        from zeroplus.ledger import Category
        ledger = {c.value: [engine.ledger.live_bytes(c), engine.ledger.peak_bytes(c),
                            engine.ledger.at_peak.get(c, 0)] for c in Category}
    with open(f"{args.out_prefix}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak_above_start_bytes": peak, "step_seconds": times, "losses": losses,
                   "params": n_params, "ledger_live_peak": ledger,
                   "collective_volume": volumes, "device": str(meter.device),
                   **({"ops": census.counts()} if args.count_ops else {})}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (DeepSpeed aborts in it on CPU)


if __name__ == "__main__":
    main()
