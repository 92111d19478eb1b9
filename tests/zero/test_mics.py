"""MiCS / HSDP (``zero_optimization.mics_shard_size``): ZeRO shards within groups of consecutive data ranks and
replicates across them; gradients are reduce-scattered within a shard group and averaged across the replicas before
the step (``parallel/topology.py``'s ``shard`` and ``replica`` groups, ``zero/sharded_step.py``; see note: mics).

4 gloo ranks as 2 shard groups of 2 (what 2 nodes of 2 would run), ``ParityNet`` with accumulation 2 and binding
clipping: at stages 1 and 3 with AdamW, and at stage 3 with SGD (momentum: not invariant to the gradient's scale,
so a wrong averaging factor shows), the losses, the global gradient norm and every trained weight equal the plain
module's within ``test_parity``'s tolerance (1e-6 relative, 3e-6 of a tensor's largest value: the four parts of a
gradient are summed in another order); each flat group is partitioned over 2 ranks (each rank owns half of it, where
flat ZeRO over 4 owns a quarter) and every replica holds the same shards. A checkpoint saved under MiCS at stage 3
loads into flat ZeRO-3 over the 4 ranks with the weights it saved, and the engine's memory estimate predicts each
model-state category's peak as the ledger measures it. The comms log's bytes a step at stage 3: across the replicas
(the link between nodes) one all-reduce of the shard, exactly; within a shard group a reduce-scatter of its elements
per micro-batch, exactly, and at least two gathers. (Measured 2026-12-06 per micro-batch: every group gathered in
forward and the blocks' again in backward, the root unit staying gathered through backward, plus the embedding's
sparse rows, 16 + 256 + 1664 bytes of counts, ids and values, which at 2 ranks cost 8 bytes less than its dense
gradient by ``row_reduce.choose_dense``'s count: see note: sparse embedding rows.)
Refused on every rank, naming the key, the value and the
rank: stage 0, a shard size that does not divide the data ranks.
"""
from __future__ import annotations

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, initialize_says, reference_train
from zeroplus.ledger import Category
from zeroplus.parallel import reset_parallel

STEPS, GAS, MICRO, LR, CLIP = 3, 2, 2, 1e-2, 0.5
CASES = [(1, "AdamW"), (3, "AdamW"), (3, "SGD")]  # (stage 2 reduces as stage 3 does: tests/zero/test_parity.py)


def _config(stage: int, optimizer: str = "AdamW", shard: int = 2, estimate: bool = False) -> dict:
    params = {"lr": LR, "weight_decay": 0.01} | ({"momentum": 0.9} if optimizer == "SGD" else {})
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": optimizer, "params": params},
            "zero_optimization": {"stage": stage, "mics_shard_size": shard, "reduce_bucket_size": 100,
                                  "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": estimate}}


def _runs(root: str) -> list[dict]:
    rank, world = rank_and_world()
    out = []
    for stage, optimizer in CASES:
        torch.manual_seed(0)
        estimated = (stage, optimizer) == (3, "AdamW")
        config = _config(stage, optimizer, estimate=estimated)
        config["comms_logger"] = {"enabled": estimated}
        engine = zeroplus.initialize(ParityNet(), config)
        batches = make_batches(STEPS * GAS * world, MICRO)
        losses = engine_train(engine, batches, 1, rank, world, GAS)
        if estimated:
            engine.comms_log.reset()  # (the first step's one-off collectives stay out of the count)
        losses += engine_train(engine, batches, STEPS - 1, rank, world, GAS, start=1)
        shards = {g.name: (g.dp.size, g.owned_numel, g.numel) for g in engine.partition.groups}
        masters = torch.cat([g.master_param.detach().reshape(-1) for g in engine.partition.groups])
        result = {"losses": losses, "norm": engine.get_global_grad_norm(), "state": engine.consolidated_fp32_state(),
                  "shards": shards, "data": engine.dp.size, "masters": masters}
        if estimated:  # the bytes each group moved a step, and a shard's elements (padded) in all
            result["bytes"] = {group: engine.comms_log.bytes_by_kind(group) for group in ("shard", "replica")}
            result["shard_numel"] = sum(g.shard_numel for g in engine.partition.groups)
        if estimated:  # the budget's model states: what the ledger holds, partitioned over the shard group
            assert engine.budget is not None
            result["states"] = {c: (engine.ledger.peak_bytes(Category(c)), engine.budget.category_peaks[c])
                                for c in ("param", "param_gathered", "grad", "master", "optim_state")}
            result["states"]["kept"] = (engine.ledger.live_bytes(Category.MASTER), engine.budget.model_states["master"])
            engine.save_checkpoint(root, tag="mics")
            reset_parallel()  # (groups of another layout: another config's engine makes its own)
            flat = zeroplus.initialize(ParityNet(), _config(3, shard=-1))
            flat.load_checkpoint(root, tag="mics")
            result["loaded"] = flat.consolidated_fp32_state()
            result["flat_shards"] = {g.dp.size for g in flat.partition.groups}
            flat.destroy()
            reset_parallel()
        engine.destroy()
        out.append(result)
    return out


def test_mics_trains_the_plain_modules_model_with_shards_within_groups_of_two(tmp_path):
    runs = run_distributed(_runs, 4, str(tmp_path))
    for (stage, optimizer), *per_rank in zip(CASES, *runs):
        label = f"stage {stage} {optimizer}"
        torch.manual_seed(0)
        ref_losses, ref_state = reference_train(ParityNet(), make_batches(STEPS * GAS * 4, MICRO), STEPS, 4, GAS, LR,
                                                CLIP, optimizer=optimizer)
        first = per_rank[0]
        torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{label}: losses: {m}")
        assert first["state"], label
        for name, value in first["state"].items():  # (the trained weights: the frozen one is not in it)
            ref = ref_state[name]
            torch.testing.assert_close(value, ref, rtol=1e-6, atol=3e-6 * ref.abs().max().item(),
                                       msg=lambda m, n=name: f"{label}: {n}: {m}")
        for rank, result in enumerate(per_rank):
            assert result["data"] == 4, (label, rank)
            assert all(size == 2 and owned == -(-numel // 2) for size, owned, numel in result["shards"].values()), \
                (label, rank, result["shards"])
            assert result["norm"] == first["norm"], (label, rank)
        for a, b in ((0, 2), (1, 3)):  # replicas: the same shards, bit for bit
            assert torch.equal(per_rank[a]["masters"], per_rank[b]["masters"]), (label, a, b)
        for result in per_rank if "states" in first else ():
            assert all(measured == predicted for measured, predicted in result["states"].values()), result["states"]
        for result in per_rank if "bytes" in first else ():
            # within a shard group stage 3's 3 x its elements a micro-batch (gathered twice, reduce-scattered once);
            # across the replicas the shard once a step: 2 (GAS) x 3 x 2 = 12 times fewer bytes over that link
            shard, steps, within = 4 * result["shard_numel"], STEPS - 1, result["bytes"]["shard"]
            assert result["bytes"]["replica"] == {"all_reduce": steps * shard}, result["bytes"]
            assert within["all_gather"] >= steps * GAS * 2 * 2 * shard, within  # (the frozen layer's too, and more)
            assert within["reduce_scatter"] == steps * GAS * 2 * shard, result["bytes"]  # (and the norm's scalars)
        if "loaded" in first:
            assert first["flat_shards"] == {4}
            for name, value in first["state"].items():
                assert torch.equal(first["loaded"][name], value), f"{label}: loaded into flat ZeRO-3: {name}"


REFUSED = [(0, 2, "ZeRO stage 0 shards nothing"),
           (3, 3, "mics_shard_size 3: the ranks ZeRO shards over, at least 2, dividing the data-parallel size 4")]


def _refused() -> list[str]:
    return initialize_says(ParityNet, [_config(stage, shard=shard) for stage, shard, _ in REFUSED])


def test_what_mics_cannot_run_is_refused_on_every_rank():
    for rank, said in enumerate(run_distributed(_refused, 4)):
        for (stage, shard, message), line in zip(REFUSED, said):
            assert message in line and f"rank {rank}" in line, (rank, stage, shard, line)
