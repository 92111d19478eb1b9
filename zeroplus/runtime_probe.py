"""Measure this machine's runtime overhead: what a training process holds beyond its tensors.

``python -m zeroplus.runtime_probe [--dtype fp32|bf16|fp16] [--world-size N --rank R --store FILE]`` trains
the built-in GPT ``tiny`` (about 0.3 MiB of parameters), in that compute dtype, for three steps with zeroplus on
one gloo rank in a fresh process (or as rank R of N processes meeting at a file store: what gloo holds for its
peers is measured so) and prints, as JSON:

- ``construction``: the peak the engine's own report measures at the end of ``initialize`` (resident
  memory above the process when ``initialize`` started, the model's tensors counted as the engine's:
  ``memory_report.py``; what building the model cost besides its tensors is baseline), minus the
  tensors the simulation predicts for the ``init`` phase. ``torch._dynamo``, which the first optimizer
  would import, came with ``import zeroplus`` and is in the baseline: ``budget/runtime_overhead.py``.
- ``training``: the same over two training steps, minus the predicted training peak's tensors and MKL's buffer
  pool as its prediction measured it (``host_gemm_pool.py``: a run's own pool is measured for its shapes).
- ``profiled``: what a third step, run under the FLOPs profiler (DeepSpeed's ``flops_profiler``, which the main
  job turns on: every op of the step passes through Python dispatch), put on the peak beyond ``training``.
- ``--simulations 2``: its engine's first forward simulates the run with resize recompute as well as the one
  without, as an engine whose recompute may pay does (this model's cannot: one simulation); what that adds to
  ``training`` is the record's ``second_simulation``.
- ``--kernel-cache``: then ``kernel_cache``: what the matrix-product kernel caches hold once full
  (``host_kernel_cache.py``), beyond the engine's own entries: the forward and both backward products of a
  ``KERNEL_SHAPE`` weight at ``CAPACITY / 2`` batch sizes (1.5 x the cache's entries), in the compute dtype,
  resident memory after against before (49 and 67 MiB in bf16 in two probes on 2026-12-05, on a CPU computing bf16
  natively: resident code pages move by that much between processes; in fp32 torch's products are MKL's, which
  keeps no such cache: 0.1 MiB; 0 where bf16 is emulated, its products not oneDNN's either).
- ``code_built``, ``code_constructed``, ``code_trained``: torch's code resident after the model was
  built, after ``initialize`` and after training (``budget/first_use.py``), so a process that already
  holds some of it is predicted without it.
- ``block_scaled_states``: torch's code that a step over fp8 and then mxfp8 optimizer moments pages in beyond the
  training above (``optim/stored_states.py``, stochastic rounding as their default; e4m3 and e8m0 conversions, the
  blocks' scales): 2.7-2.9 MiB here, 2026-12-06, which a run with such moments holds from its first step on.

The memory budget (``budget/runtime_overhead.py``) runs this once per machine and keeps the result.
It is run with glibc as zeroplus sets it by default (returning freed memory: ``host_allocator.py``) and
with ``ZEROPLUS_RUNTIME_BYTES`` set to the fallback figures, so the engine inside it makes the choices a user's
engine makes (resize recompute left unset stands down on this model, as it does where the overhead is in the
peak); what it prints is each measure minus the tensors predicted (``_tensor_bytes``), whatever that figure.
Memory: the probe's own, in a child process; the caller holds nothing.
"""
from __future__ import annotations

import json
import logging
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .accelerator import get_accelerator
from .budget import estimate as estimate_module
from .budget.first_use import code_resident
from .host_kernel_cache import CAPACITY
from .initialize_engine import initialize
from .models import GPT, gpt_config
from .optim.stored_states import StoredStatesAdamW, requested

SEQ = 32
PROFILED_STEP = 3  # the steps before it are what an unprofiled run holds
# K x N of the products that fill the kernel caches: an entry 0.46 MiB here in bf16 (0.31 to 0.86 over the shapes
# host_kernel_cache lists)
KERNEL_SHAPE = (512, 1024)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tensor_bytes(phase: dict[str, int]) -> int:
    return phase["total"] - phase.get("runtime", 0)


def _kernel_cache_bytes(dtype: torch.dtype) -> int:
    """Resident bytes the kernel caches hold once full, beyond what they held (``--kernel-cache``)."""
    k, n = KERNEL_SHAPE
    weight = torch.zeros(n, k, dtype=dtype, requires_grad=True)

    def product(rows: int) -> None:
        F.linear(torch.zeros(rows, k, dtype=dtype, requires_grad=True), weight).sum().backward()
    product(1)  # (what the first product pages in is not the cache's)
    accelerator = get_accelerator()
    accelerator.release_host_memory()
    before = accelerator.memory_allocated()
    for rows in range(2, 2 + CAPACITY // 2):  # three kernels each, 1.5 x the capacity: the cache ends full of these
        product(rows)
    weight.grad = None
    accelerator.release_host_memory()
    return max(0, accelerator.memory_allocated() - before)


def _block_scaled_code() -> int:
    """Resident bytes of torch's code that two steps over fp8, then mxfp8, moments page in (``block_scaled_states``)."""
    before = code_resident() or 0
    for name in ("fp8", "mxfp8"):
        param = torch.nn.Parameter(torch.randn(4096))
        param.grad = torch.randn(4096)
        optimizer = StoredStatesAdamW([param], lr=1e-4, fused=True, **(requested(name, name, None, False) or {}))
        optimizer.step()
        optimizer.step()
    return max(0, (code_resident() or 0) - before)


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    dtype = _arg("--dtype", "fp32")  # (runtime_overhead.DTYPES)
    if _arg("--simulations", "1") == "2":  # the run with resize recompute simulated too, whatever its bound says
        estimate_module.droppable_at_peak = lambda off: off.steps_peak_bytes
    world_size, rank = int(_arg("--world-size", "1")), int(_arg("--rank", "0"))
    logging.disable(logging.WARNING)
    store = dist.HashStore() if world_size == 1 else dist.FileStore(_arg("--store", ""), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    code_built = code_resident() or 0
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3}, "zeroplus": {"log_level": "error"},
              "flops_profiler": {"enabled": True, "profile_step": PROFILED_STEP},
              "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}
    engine = initialize(model, config)
    constructed = engine.memory_report().process_peak_above_start_bytes  # the basis every report measures on
    code_constructed = code_resident() or 0
    tokens = torch.randint(0, gpt_config("tiny").vocab_size, (2, SEQ))
    for step in range(1, PROFILED_STEP + 1):
        engine.backward(engine(tokens, tokens))
        engine.step()
        if step == PROFILED_STEP - 1:
            trained = engine.memory_report().process_peak_above_start_bytes
            code_trained = code_resident() or 0
    profiled = engine.memory_report().process_peak_above_start_bytes - trained
    block_scaled = _block_scaled_code()
    budget = engine.budget
    if budget is None:
        raise RuntimeError("the runtime probe's engine made no memory prediction")
    result = {"code_built": code_built, "code_constructed": code_constructed, "code_trained": code_trained,
              "construction": max(0, constructed - _tensor_bytes(budget.phases["init"])),
              "training": max(0, trained - _tensor_bytes(budget.phases[budget.training_peak_phase])
                              - budget.host_buffers),
              "profiled": max(0, profiled), "block_scaled_states": block_scaled}
    if "--kernel-cache" in sys.argv:
        result["kernel_cache"] = _kernel_cache_bytes(DTYPES[dtype])
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
