"""Benchmark: the fused operators (``kernels/``) against their reference twins, forward and backward, on this device.

For each operator at a Llama-like shape (``--tokens`` rows of width ``--hidden``, MLP width ``--ffn``), the
median time of forward plus backward over ``--repeats`` runs after two warm-ups, and the bytes autograd keeps
from forward to backward (distinct storages, counted by saved-tensor hooks), for: the reference (eager), the
reference under ``torch.compile`` (inductor; its compile time left out), and zeroplus's kernel, the one
``zeroplus.fused_ops`` installs on this device where it installs one. Grouped GEMM: ``--experts`` experts with
equal rows. One process, ``--threads`` threads.

    python bench/bench_fused_ops.py                      # bf16, 4096 tokens, 1024 x 2816
    python bench/bench_fused_ops.py --dtype fp32 --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from zeroplus.kernels.grouped_gemm import grouped_mm, grouped_mm_reference  # noqa: E402
from zeroplus.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from zeroplus.kernels.rotary import rotary_reference  # noqa: E402
from zeroplus.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402


def measure(fn: Callable[..., Any], make: Callable[[], list[torch.Tensor]], repeats: int) -> tuple[float, int]:
    """(median seconds of forward + backward, bytes kept for backward)."""
    times, kept = [], 0
    for i in range(repeats + 2):
        inputs = make()
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        if i >= 2:
            times.append(time.perf_counter() - start)
            kept = sum(storages.values())
    return statistics.median(times), kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    n, d, f, h = args.tokens, args.hidden, args.ffn, args.heads
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    cos, sin = torch.randn(1, n, d // h, generator=g).to(dtype), torch.randn(1, n, d // h, generator=g).to(dtype)
    ends = torch.arange(1, args.experts + 1, dtype=torch.int32) * (n // args.experts)
    ops = {  # name: (reference, zeroplus's kernel or None, inputs)
        "rms_norm": (lambda x, w: rms_norm_reference(x, w, 1e-6), lambda x, w: rms_norm(x, w, 1e-6),
                     lambda: [leaf(n, d), leaf(d)]),
        "swiglu": (swiglu_reference, swiglu, lambda: [leaf(n, f), leaf(n, f)]),
        "rotary": (lambda q, k: rotary_reference(q, k, cos, sin), None,
                   lambda: [leaf(1, h, n, d // h), leaf(1, h, n, d // h)]),
        "grouped_gemm": (grouped_mm_reference, grouped_mm,
                         lambda: [leaf(n, d), leaf(args.experts, d, f // args.experts * 2), ends]),
    }
    print(f"{args.dtype}, {n} tokens, hidden {d}, MLP {f}, {h} heads, {args.experts} experts, "
          f"{torch.get_num_threads()} threads; forward + backward, median of {args.repeats}")
    print(f"{'operator':<14}{'variant':<12}{'ms':>9}{'x reference':>13}{'kept MiB':>10}")
    for name, (ref, fused, make) in ops.items():
        variants: dict[str, Callable[..., Any]] = {"reference": ref}
        if not args.no_compile:
            variants["compiled"] = torch.compile(ref, dynamic=False)
        if fused is not None:
            variants["zeroplus"] = fused
        base = None
        for variant, fn in variants.items():
            seconds, kept = measure(fn, make, args.repeats)
            base = base or seconds
            print(f"{name:<14}{variant:<12}{1e3 * seconds:>9.2f}{base / seconds:>13.2f}{kept / 2**20:>10.1f}")


if __name__ == "__main__":
    main()
