"""``initialize`` moves, casts and partitions the model one unit at a time: what it allocates never
exceeds the shards it ends with plus one unit's flat buffer, the caller's copy of each parameter is
released as its unit is partitioned (unless the caller still holds it), every rank starts from rank
0's values, and training is unchanged (the ZeRO parity tests train through the same path)."""
from __future__ import annotations

import weakref

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.new_storage import NewStorageBytes
from zeroplus.models import GPT, gpt_config

SLACK = 4096  # scalars and per-collective bookkeeping tensors


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"memory_estimate": False, "log_level": "warning"}}


def _init_job(stage: int, keep_state_dict: bool) -> dict:
    rank, _ = rank_and_world()
    torch.manual_seed(rank)  # ranks built differently: initialize gives every rank rank 0's values
    model = GPT(gpt_config("tiny", n_layer=12))
    first_values = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
    kept = model.state_dict() if keep_state_dict else None
    storages = [weakref.ref(p.untyped_storage()) for p in model.parameters()]
    assert all(ref() is not None for ref in storages)
    with NewStorageBytes() as new:
        engine = zeroplus.initialize(model, _config(stage))
    final = engine.ledger.live_bytes()
    unit_bytes = max(u.numel for u in engine.partition.units) * 2  # one unit's bf16 flat buffer
    names = {n for n, _ in model.named_parameters()}
    values = {n: t.float() for n, t in model.state_dict().items() if n in names}  # gathered at stage 3
    return {"peak": new.peak, "final": final, "unit_bytes": unit_bytes, "values": values, "first": first_values,
            "released": sum(ref() is None for ref in storages), "params": len(storages), "kept": kept is not None}


def _both_jobs() -> tuple[dict, dict]:
    return _init_job(3, False), _init_job(3, True)


def test_initialize_holds_at_most_one_unit_beyond_the_shards():
    results = run_distributed(_both_jobs, 4)
    for r, with_kept in results:
        # 4 ranks: the old whole-model cast held a bf16 copy of every parameter, twice the fp32 shards
        assert r["peak"] <= r["final"] + r["unit_bytes"] + SLACK, (r["peak"], r["final"], r["unit_bytes"])
        assert r["released"] == r["params"], r  # the fp32 copy the model was built with is gone
        assert with_kept["released"] == 0 and with_kept["kept"]  # unless the caller keeps a state dict
    first = results[0][0]["first"]
    for r, _ in results:
        for name, value in r["values"].items():
            assert torch.equal(value, first[name].to(torch.bfloat16).float()), name
