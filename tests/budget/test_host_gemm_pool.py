"""MKL's buffer pool: what a CPU process's fp32 products keep after they return is predicted as it ends up.

MKL keeps every packing buffer its products allocated in a pool of its own (``zeroplus/host_gemm_pool.py``; see
note: mkl buffer pool): 0.1 to 5 MiB a buffer by the product's shape, as many as calls found none large enough.
The budget runs the simulation's distinct products once, in the order the run first calls them, from an empty pool,
and adds what MKL then counts from the first forward on; a process that pooled buffers before ``initialize`` has them
in its baseline, and only the rest is added. The run then finds the pool as the prediction left it: after training it
holds exactly the bytes predicted, neither more (a product the replay missed, or shapes in another order) nor fewer.

One rank in its own process (the pool starts empty there): a GPT written with its own module classes at ZeRO-3 and the
built-in GPT (``torch.nn`` classes) at ZeRO-1, then the first again in the same process, whose pool holds its buffers.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import PlainGPT
from zeroplus.host_gemm_pool import _mkl, held_bytes
from zeroplus.models import GPT, gpt_config

pytestmark = pytest.mark.skipif(_mkl() is None, reason="this torch's CPU products are not MKL's")


def _train(name: str, stage: int) -> tuple[int, int, int]:
    """(MKL's pool at ``initialize``, the budget's figure for it, the pool after two steps)."""
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
    return start, engine.budget.host_buffers, held_bytes()


def _runs() -> dict[str, tuple[int, int, int]]:
    return {"own": _train("own", 3), "nn": _train("nn", 1), "own again": _train("own", 3)}


def test_the_pool_after_training_is_the_pool_predicted():
    runs = run_distributed(_runs, 1)[0]
    start, predicted, after = runs["own"]
    assert start == 0 and predicted > 2**20 and after == predicted, runs  # a fresh process: all of it added
    pooled = after
    start, predicted, after = runs["nn"]  # the pool emptied and grown to this model's; only growth is added
    assert start == pooled and 0 < after and predicted == max(0, after - start), runs
    start, predicted, after = runs["own again"]
    assert after == pooled and predicted == pooled - start > 0, runs
