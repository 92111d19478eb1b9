"""Bytes per ledger category, asserted against the partition math from parameter counts.

After a step (2 ranks, ParityNet, AdamW), for each group of P padded elements and S = P / 2:
  stage 0-2: param = c * P;              stage 3: param = c * F / 2 (the frozen layer's shard; the
                                         gathers cast the master)
  master     = 4 * owned at stages 0-2 (0 when fp32: the parameter is the master); 4 * S at stage 3
  optim_state = 2 * 4 * owned (exp_avg, exp_avg_sq)
  grad = 0 (gradients are freed after the step)
  param_gathered = 0, except at stage 3: the root unit and the first block, gathered ahead
  comm_buffer = 0, except at stage 3 in bf16: those two units' cast shards, until the gather lands
with owned = P at stage 0 and S otherwise, c = 2 for bf16 and 4 for fp32. At stage 3 the
gathered peak stays below the root unit plus two block units plus the prefetch window.
"""
from __future__ import annotations

import time

import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import ParityNet, make_batches
from zeroplus.ledger import Category


def _run(cases: list[tuple[int, str]]) -> list[dict]:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for stage, dtype in cases:
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": dtype == "bf16"},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                     "stage3_prefetch_bucket_size": 1},
               "zeroplus": {"log_level": "warning"}}
        engine = zeroplus.initialize(ParityNet(), cfg)
        batches = make_batches(2 * world, 2)
        for step in range(2):
            x, y = batches[step * world + rank]
            engine.backward(engine(x, y))
            engine.step()
        part = engine.partition
        # gloo's worker thread drops its reference to a finished bucket a moment after wait()
        # returns; give it that moment so live bytes are read after the last free.
        # At stage 3 in bf16 the prefetch for the next forward casts its shards (c * S each for the
        # root and the first block) into comm buffers; on gloo the all-gather (an in-place
        # all-reduce, comm.py) copies them into the gathered buffer when issued, so none is left.
        in_flight = engine.dp.pair_bytes  # (two ranks of one host: the shared pair's mapping stays, shm_pair.py)
        deadline = time.monotonic() + 5
        while (engine.ledger.live_bytes(Category.COMM_BUFFER) > in_flight or engine.ledger.live_bytes(Category.GRAD)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        units = [(u.is_root, [(g.padded_numel, g.shard_numel, g.owned_numel) for g in u.groups]) for u in part.units]
        frozen = [[(g.padded_numel, g.shard_numel) for g in u.frozen] for u in part.units]
        layouts = sorted({g.layout.value for g in part.groups}), sorted({g.layout.value for g in part.frozen})
        out.append({"report": engine.memory_report().to_dict(), "units": units, "frozen": frozen,
                    "in_flight": in_flight, "layouts": layouts})
    return out


CASES = [(s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]


def test_ledger_bytes_per_category_match_partition_math():
    results = run_distributed(_run, 2, CASES)
    for rank, per_rank in enumerate(results):
        for (stage, dtype), r in zip(CASES, per_rank):
            c = 2 if dtype == "bf16" else 4
            groups = [g for _, gs in r["units"] for g in gs]
            owned = sum(o for _, _, o in groups)
            live = {k: v["live_bytes"] for k, v in r["report"]["categories"].items()}
            label = f"stage {stage} {dtype} rank {rank}"
            frozen_shards = sum(s for fs in r["frozen"] for _, s in fs)
            assert (frozen_shards > 0) == (stage == 3), label  # ParityNet's frozen layer, partitioned at stage 3
            expected_param = c * frozen_shards if stage == 3 else c * sum(p for p, _, _ in groups)
            expected_master = 4 * owned if stage == 3 or dtype == "bf16" else 0
            assert live[Category.PARAM.value] == expected_param, label
            assert live[Category.MASTER.value] == expected_master, label
            # the master layout each (stage, dtype) names (flat_group.MasterLayout), whose bytes these are
            trained = "low precision" if dtype == "bf16" else ("fp32 own" if stage == 3 else "fp32 alias")
            assert r["layouts"] == ([trained], ["frozen"] if stage == 3 else []), label
            assert live[Category.OPTIM_STATE.value] == 2 * 4 * owned, label
            assert live[Category.GRAD.value] == 0, label
            # stage 3 gathers the root unit and the first block ahead of the next forward
            first_two = c * (sum(p for p, _, _ in r["units"][-1][1]) + sum(p for p, _, _ in r["units"][0][1])
                             + sum(p for p, _ in r["frozen"][-1] + r["frozen"][0]))
            assert live[Category.PARAM_GATHERED.value] == (first_two if stage == 3 else 0), label
            assert live[Category.COMM_BUFFER.value] == r["in_flight"], label
            if stage == 3:
                root = sum(p for is_root, gs in r["units"] if is_root for p, _, _ in gs) + sum(
                    p for p, _ in r["frozen"][-1])
                blocks = sorted((sum(p for p, _, _ in gs) for is_root, gs in r["units"] if not is_root), reverse=True)
                bound = c * (root + blocks[0] + blocks[1])
                peak = r["report"]["categories"][Category.PARAM_GATHERED.value]["peak_bytes"]
                assert 0 < peak <= bound, f"{label}: gathered peak {peak} > {bound}"


def test_stage3_model_states_are_one_shard():
    """At stage 3 with 2 ranks, parameters + masters take 4 bytes per owned element (bf16 adds
    nothing: no low-precision shard is kept), against stage 2's 2 * P + 4 * S."""
    results = run_distributed(_run, 2, [(2, "bf16"), (3, "bf16")])[0]
    sizes = [sum(p for _, gs in r["units"] for p, _, _ in gs) for r in results]
    states = [r["report"]["categories"][Category.PARAM.value]["live_bytes"]
              + r["report"]["categories"][Category.MASTER.value]["live_bytes"] for r in results]
    frozen = sum(p for fs in results[1]["frozen"] for p, _ in fs)  # the frozen layer: a bf16 shard only
    assert states[0] == 2 * sizes[0] + 4 * sizes[0] // 2
    assert states[1] == 4 * sizes[1] // 2 + 2 * frozen // 2
