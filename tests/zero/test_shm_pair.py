"""Two gloo ranks of one host swap large all-gathers and gradient exchanges through shared memory
(``zeroplus/shm_pair.py``): the same bytes as gloo's path, the mapping in the ledger, training bit for bit as with
gloo, and a peer that swaps a different size, stalls or is gone makes the waiting rank raise a ``CollectiveError``.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import train_losses
from zeroplus import shm_pair
from zeroplus.collective_faults import CollectiveError, set_timeout_seconds
from zeroplus.comm import DataParallelGroup
from zeroplus.ledger import Category, Ledger
from zeroplus.models import GPT, gpt_config


def _pieces(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _swapped(shared: bool) -> dict:
    """All-gathers (fp32, bf16, a size that is no multiple of a slot, one under ``MIN_BYTES``), exchanges, sums and
    reduces onto each (fp32, bf16), several in flight at once and waited in another order than issued, with or
    without the pair."""
    dp, ledger = DataParallelGroup(), Ledger()
    if shared:
        dp.use_transport("pair", ledger)
    r = dp.rank
    sizes = [(3 * shm_pair.SLOT_BYTES // 4 + 12345, torch.float32), (shm_pair.SLOT_BYTES + 7, torch.bfloat16),
             (1000, torch.float32)]
    outs, handles = [], []
    for k, (n, dtype) in enumerate(sizes):
        out = torch.full((2 * n,), float("nan"), dtype=dtype)
        outs.append(out)
        handles.append(dp.all_gather(out, _pieces(r, n, dtype, k)))
    n = shm_pair.SLOT_BYTES // 2 + 3  # a fresh shard at two ranks: the row exchange
    rows = torch.stack([_pieces(r, n, torch.float32, 10 + i) for i in range(2)])
    into = torch.full((n,), float("nan"))
    handles.append(dp.reduce_scatter_rows(rows, into, 1.0, False, ledger))
    summed = [_pieces(r, 2 * shm_pair.SLOT_BYTES // 4 + 99, dtype, 20) for dtype in (torch.float32, torch.bfloat16)]
    handles += [dp.all_reduce(t) for t in summed]
    n = shm_pair.SLOT_BYTES // 4 + 5
    reduced = [torch.stack([_pieces(r, n, dtype, 30 + i) for i in range(2)])
               for dtype in (torch.float32, torch.bfloat16)]
    shards = [torch.zeros(n, dtype=pieces.dtype) for pieces in reduced]  # added into: a reduce of two onto each
    handles += [dp.reduce_scatter_rows(pieces, shard, 1.0, True, ledger) for pieces, shard in zip(reduced, shards)]
    for h in reversed(handles):
        h.wait()
    return {"paired": dp.pair is not None, "comm_bytes": ledger.live_bytes(Category.COMM_BUFFER),
            "outs": outs, "into": into, "summed": summed, "reduced": shards,
            "sent": dict(dp.bytes_sent)}


def test_the_pair_moves_the_bytes_gloo_moves():
    """Every all-gather, exchange, sum and reduce lands bit for bit what gloo's path lands, with several in flight;
    the mapping is 4 MiB and a header in the ledger; the bytes counted are the same."""
    shared, plain = run_distributed(_swapped, 2, True), run_distributed(_swapped, 2, False)
    for r in range(2):
        assert shared[r]["paired"] and not plain[r]["paired"]
        assert shared[r]["comm_bytes"] == shm_pair.MAPPING_BYTES == 4 * 2**20 + 4096, shared[r]["comm_bytes"]
        assert plain[r]["comm_bytes"] == 0
        for a, b in zip(shared[r]["outs"], plain[r]["outs"]):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # (bits: NaN would differ from itself)
        assert torch.equal(shared[r]["into"], plain[r]["into"])
        n = shm_pair.SLOT_BYTES // 2 + 3
        expected = _pieces(0, n, torch.float32, 10 + r) + _pieces(1, n, torch.float32, 10 + r)
        assert torch.equal(shared[r]["into"], expected)
        for i, dtype in enumerate((torch.float32, torch.bfloat16)):  # gloo's sum, on both ranks
            n = 2 * shm_pair.SLOT_BYTES // 4 + 99
            expected = _pieces(0, n, dtype, 20) + _pieces(1, n, dtype, 20)
            for got in (shared[r]["summed"][i], plain[r]["summed"][i], shared[1 - r]["summed"][i]):
                assert torch.equal(got, expected), (r, dtype)
            n = shm_pair.SLOT_BYTES // 4 + 5  # a reduce of two onto each: rank r's piece r holds the sum
            expected = _pieces(0, n, dtype, 30 + r) + _pieces(1, n, dtype, 30 + r)
            assert torch.equal(shared[r]["reduced"][i], expected) and torch.equal(plain[r]["reduced"][i], expected)
        assert shared[r]["sent"] == plain[r]["sent"]
    for k, (n, dtype) in enumerate([(3 * shm_pair.SLOT_BYTES // 4 + 12345, torch.float32)]):
        expected = torch.cat([_pieces(0, n, dtype, k), _pieces(1, n, dtype, k)])
        assert torch.equal(shared[0]["outs"][0], expected)


def _config(stage: int, shared: bool, accumulation: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "shared_memory_pair": shared}}


def _trained(stage: int, accumulation: int, shared: bool) -> dict:
    torch.manual_seed(0)
    engine = zeroplus.initialize(GPT(gpt_config("tiny", n_embd=128, vocab_size=4096)),
                                 _config(stage, shared, accumulation))
    losses = train_losses(engine, hugging_face=False, vocab=4096, seq=32, seed=engine.dp.rank, steps=3 * accumulation)
    swapped = engine.dp.pair.chunks_sent if engine.dp.pair is not None else 0
    return {"losses": losses, "state": engine.consolidated_fp32_state(), "swapped": swapped}


@pytest.mark.parametrize("stage,accumulation", [(0, 1), (1, 1), (2, 1), (3, 1), (2, 2), (3, 2)])
def test_training_through_the_pair_is_bit_for_bit_gloos(stage, accumulation):
    """Two ranks of a GPT whose groups are over ``MIN_BYTES``: losses and every parameter after three steps equal
    to the bit with the pair and without it, and the pair carried chunks (gradient accumulation: the reduces onto
    each rank's shard)."""
    shared = run_distributed(_trained, 2, stage, accumulation, True)
    plain = run_distributed(_trained, 2, stage, accumulation, False)
    for r in range(2):
        assert shared[r]["swapped"] > 0 and plain[r]["swapped"] == 0, (shared[r]["swapped"], plain[r]["swapped"])
        assert shared[r]["losses"] == plain[r]["losses"], (shared[r]["losses"], plain[r]["losses"])
        for name, value in plain[r]["state"].items():
            assert torch.equal(shared[r]["state"][name], value), name


def _faulty(what: str) -> dict:
    dp = DataParallelGroup()
    dp.use_transport("pair", Ledger())
    set_timeout_seconds(2.0)
    r = dp.rank
    n = shm_pair.SLOT_BYTES if what != "sizes" or r == 0 else shm_pair.SLOT_BYTES * 2
    start = time.monotonic()
    if what == "gone" and r == 1:
        return {"error": None}  # leaves without a word: its process ends
    if what == "stall" and r == 1:
        time.sleep(6.0)
        return {"error": None}
    try:
        dp.all_gather(torch.zeros(2 * n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)).wait()
    except CollectiveError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("what,says", [("sizes", "the ranks swap different sizes"), ("stall", "did not come within"),
                                       ("gone", "is gone")])
def test_a_peer_that_differs_stalls_or_is_gone_raises(what, says):
    """The waiting rank raises a ``CollectiveError`` naming the collective and why, within the timeout (2 s) plus the
    roll call (3 s); ranks that swap different sizes both raise (neither reads the other's bytes as its own)."""
    results = run_distributed(_faulty, 2, what)
    ranks = [0, 1] if what == "sizes" else [0]
    for r in ranks:
        got = results[r]
        assert got["error"] and "all_gather #" in got["error"] and says in got["error"], got
        assert got["seconds"] < 2.0 + 3.0 + 3.0, got


def _pair_made(key: bool, env: bool) -> bool:
    if not env:
        os.environ[shm_pair.ENV_OFF] = "0"
    torch.manual_seed(0)
    engine = zeroplus.initialize(GPT(gpt_config("tiny")), _config(1, key))
    return engine.dp.pair is not None and engine.dp.transport == "pair"


def test_the_key_or_the_variable_keeps_gloo():
    """``zeroplus.shared_memory_pair`` false or ``ZEROPLUS_SHM_PAIR=0``: no pair; neither: a pair."""
    assert run_distributed(_pair_made, 2, True, True) == [True, True]
    assert run_distributed(_pair_made, 2, False, True) == [False, False]
    assert run_distributed(_pair_made, 2, True, False) == [False, False]
