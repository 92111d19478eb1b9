"""MKL's buffer pool: what a CPU process's fp32 products keep after they return is predicted as it ends up.

MKL keeps every packing buffer its products allocated in a pool of its own (``zeroplus/host_gemm_pool.py``; see
note: mkl buffer pool), as many as calls found none large enough; what that costs is the part of each buffer the
products wrote (all of it on an AMD EPYC with AVX2, about a fortieth on an Intel Xeon with AVX-512). ``initialize``
releases the process's pool before its start; the budget runs the simulation's distinct products once, in the order
the run first calls them, from an empty pool, and adds the resident bytes that pool gave back when emptied, from the
first forward on. The run then grows the pool as the replay did: after training, emptying it gives back exactly the
bytes predicted within the spread of one figure between processes (``tests/same_budget.py``), neither more (a
product the replay missed, or shapes in another order) nor fewer.

One rank in its own process: a GPT written with its own module classes at ZeRO-3 and the built-in GPT (``torch.nn``
classes) at ZeRO-1, then the first again in the same process, whose pool holds the second's buffers when it starts.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import PlainGPT
from tests.same_budget import POOL_SPREAD
from zeroplus.host_gemm_pool import _mkl, held_bytes, release
from zeroplus.models import GPT, gpt_config

pytestmark = pytest.mark.skipif(_mkl() is None, reason="this torch's CPU products are not MKL's")


def _train(name: str, stage: int, empty_after: bool = True) -> tuple[int, int, int | None]:
    """(MKL's count of its pool before ``initialize``, the budget's figure for the pool, the resident bytes emptying
    the pool gives back after two steps; None where ``empty_after`` is False and the pool is left as it is)."""
    torch.manual_seed(0)
    own = name == "own"
    model = PlainGPT(vocab=4096, d=128, layers=2, heads=4, seq=64) if own else GPT(gpt_config("small"))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "warning"}}
    start = held_bytes()
    engine = zeroplus.initialize(model, config)
    vocab = 4096 if own else gpt_config("small").vocab_size
    for seed in range(2):
        x = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(seed))
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten()) if own else engine(x, x)
        engine.backward(loss)
        engine.step()
    assert engine.budget is not None
    return start, engine.budget.host_buffers, release() if empty_after else None


def _runs() -> dict[str, tuple[int, int, int | None]]:
    return {"own": _train("own", 3), "nn": _train("nn", 1, empty_after=False), "own again": _train("own", 3)}




def test_the_pool_after_training_is_the_pool_predicted():
    runs = run_distributed(_runs, 1)[0]
    start, predicted, after = runs["own"]
    assert start == 0 and predicted > 0 and abs(after - predicted) <= POOL_SPREAD, runs  # a fresh process
    assert runs["nn"][0] == 0 and runs["nn"][1] > 0, runs
    start, predicted, after = runs["own again"]  # the nn GPT's buffers pooled: released at initialize, not counted
    assert start > 0 and abs(predicted - runs["own"][1]) <= POOL_SPREAD, runs
    assert abs(after - predicted) <= POOL_SPREAD, runs
