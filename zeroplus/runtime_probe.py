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
- ``training``: the same over two training steps, minus the predicted training peak's tensors.
- ``profiled``: what a third step, run under the FLOPs profiler (DeepSpeed's ``flops_profiler``, which the main
  job turns on: every op of the step passes through Python dispatch), put on the peak beyond ``training``.
- ``--simulations 2``: its engine's first forward simulates the run with resize recompute as well as the one
  without, as an engine whose recompute may pay does (this model's cannot: one simulation); what that adds to
  ``training`` is the record's ``second_simulation``.
- ``code_built``, ``code_constructed``, ``code_trained``: torch's code resident after the model was
  built, after ``initialize`` and after training (``budget/first_use.py``), so a process that already
  holds some of it is predicted without it.

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

from .budget import estimate as estimate_module
from .budget.first_use import code_resident
from .initialize_engine import initialize
from .models import GPT, gpt_config

SEQ = 32
PROFILED_STEP = 3  # the steps before it are what an unprofiled run holds


def _tensor_bytes(phase: dict[str, int]) -> int:
    return phase["total"] - phase.get("runtime", 0)


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
    budget = engine.budget
    if budget is None:
        raise RuntimeError("the runtime probe's engine made no memory prediction")
    result = {"code_built": code_built, "code_constructed": code_constructed, "code_trained": code_trained,
              "construction": max(0, constructed - _tensor_bytes(budget.phases["init"])),
              "training": max(0, trained - _tensor_bytes(budget.phases[budget.training_peak_phase])),
              "profiled": max(0, profiled)}
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
