"""Benchmark: the fused operators (``kernels/``) against their reference twins, forward and backward, on this device.

For each operator at a Llama-like shape (``--tokens`` rows of width ``--hidden``, MLP width ``--ffn``), the
median time of forward plus backward over ``--repeats`` runs after two warm-ups, and the bytes autograd keeps
from forward to backward (distinct storages, counted by saved-tensor hooks), for: the reference (eager), the
reference under ``torch.compile`` (inductor; its compile time left out), and zeroplus's kernel, the one
``zeroplus.fused_ops`` installs on this device where it installs one. Grouped GEMM: ``--experts`` experts with
equal rows; ``moe_experts``: ``--experts`` SwiGLU experts of width ``--ffn / --experts`` on equal slots, the
per-expert loop (``expert_loop``) against the stacked experts' batched products (``GroupedExperts``, what
``MoE`` runs with a ``GroupedFFN``); ``cross_entropy``: ``--tokens`` rows of ``--vocab`` logits against class
targets, ``F.cross_entropy`` against ``cross_entropy_rows`` (the lean loss). One process, ``--threads`` threads.
``--device cuda`` times on the GPU (synchronised around each run), adds Liger's Triton kernels (``liger`` rows:
RMSNorm, SwiGLU, and cross-entropy, which writes the gradient into the logits in forward) where ``liger_kernel``
is installed, and a ``peak MiB`` column: the device allocator's peak over forward and backward above what was
allocated once the inputs were made.

    python bench/bench_fused_ops.py                      # bf16, 4096 tokens, 1024 x 2816
    python bench/bench_fused_ops.py --dtype fp32 --threads 1
    python bench/bench_fused_ops.py --device cuda
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zeroplus.kernels.cross_entropy_rows import cross_entropy_rows  # noqa: E402
from zeroplus.kernels.grouped_gemm import grouped_mm, grouped_mm_reference  # noqa: E402
from zeroplus.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from zeroplus.kernels.rotary import rotary_reference  # noqa: E402
from zeroplus.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402
from zeroplus.parallel.grouped_experts import GroupedExperts, GroupedFFN, expert_loop  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _liger(device: str) -> dict[str, Callable[..., Any]]:
    """Liger's RMSNorm (casting as Llama does: fp32 inside), SwiGLU and cross-entropy, where it is installed
    (CUDA only)."""
    if device != "cuda":
        return {}
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return {}
    return {"rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False),
            "swiglu": lambda a, b: LigerSiLUMulFunction.apply(a, b),
            "cross_entropy": lambda x, t: LigerCrossEntropyFunction.apply(x, t, None)[0]}


def measure(fn: Callable[..., Any], make: Callable[[], list[torch.Tensor]], repeats: int,
            device: str = "cpu") -> tuple[float, int, int]:
    """(median seconds of forward + backward, bytes kept for backward, the device allocator's peak bytes over
    forward and backward above what was allocated before them; 0 on the CPU)."""
    times, kept, peak = [], 0, 0
    for i in range(repeats + 2):
        inputs = make()
        _sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
            kept = sum(storages.values())
            if device == "cuda":
                peak = torch.cuda.max_memory_allocated() - before
        del inputs, out, outs
    return statistics.median(times), kept, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000, help="the cross-entropy row's classes")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    n, d, f, h = args.tokens, args.hidden, args.ffn, args.heads
    dev = args.device
    g = torch.Generator(device=dev).manual_seed(0)  # inputs made on the device: host randn of 10^8 takes seconds

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(dtype).requires_grad_()

    cos = torch.randn(1, n, d // h, generator=g, device=dev).to(dtype)
    sin = torch.randn(1, n, d // h, generator=g, device=dev).to(dtype)
    ends = (torch.arange(1, args.experts + 1, dtype=torch.int32) * (n // args.experts)).to(dev)
    liger = _liger(dev)
    stacked = GroupedExperts(args.experts, d, GroupedFFN(f // args.experts, "swiglu")).to(dev, dtype)
    ops = {  # name: (reference, zeroplus's kernel or None, inputs)
        "rms_norm": (lambda x, w: rms_norm_reference(x, w, 1e-6), lambda x, w: rms_norm(x, w, 1e-6),
                     lambda: [leaf(n, d), leaf(d)]),
        "swiglu": (swiglu_reference, swiglu, lambda: [leaf(n, f), leaf(n, f)]),
        "rotary": (lambda q, k: rotary_reference(q, k, cos, sin), None,
                   lambda: [leaf(1, h, n, d // h), leaf(1, h, n, d // h)]),
        "grouped_gemm": (grouped_mm_reference, grouped_mm,
                         lambda: [leaf(n, d), leaf(args.experts, d, f // args.experts * 2), ends]),
        "moe_experts": (lambda x: expert_loop(stacked, x), stacked, lambda: [leaf(args.experts, n // args.experts, d)]),
        "cross_entropy": (F.cross_entropy, cross_entropy_rows,
                          lambda: [leaf(n, args.vocab),
                                   torch.randint(0, args.vocab, (n,), generator=g, device=dev)]),
    }
    print(f"{dev}, {args.dtype}, {n} tokens, hidden {d}, MLP {f}, {h} heads, {args.experts} experts, "
          f"{torch.get_num_threads()} threads; forward + backward, median of {args.repeats}")
    print(f"{'operator':<14}{'variant':<12}{'ms':>9}{'x reference':>13}{'kept MiB':>10}{'peak MiB':>10}")
    for name, (ref, fused, make) in ops.items():
        variants: dict[str, Callable[..., Any]] = {"reference": ref}
        if not args.no_compile:
            variants["compiled"] = torch.compile(ref, dynamic=False)
        if fused is not None:
            variants["zeroplus"] = fused
        if name in liger:
            variants["liger"] = liger[name]
        base = None
        for variant, fn in variants.items():
            seconds, kept, peak = measure(fn, make, args.repeats, dev)
            base = base or seconds
            shown = f"{peak / 2**20:>10.1f}" if dev == "cuda" else f"{'-':>10}"
            print(f"{name:<14}{variant:<12}{1e3 * seconds:>9.2f}{base / seconds:>13.2f}{kept / 2**20:>10.1f}{shown}")


if __name__ == "__main__":
    main()
