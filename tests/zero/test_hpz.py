"""hpZ (ZeRO++'s hierarchical partitioning, ``zero_optimization.zero_hpz_partition_size``): at stage 3 each unit's
values gathered for a forward are also kept split over the secondary group (consecutive data ranks: a node), and the
unit's later gathers until the step (its backward, the next micro-batch's forward and backward) read them there
(``zero/flat_group.py``; see note: hpz).

4 gloo ranks as 2 simulated nodes of 2, ``ParityNet`` at stage 3 with accumulation 2 and binding clipping, against
flat ZeRO-3 over the same 4 ranks: the losses, the global gradient norm and every master shard bit for bit (a gather
from the secondary copy carries the same values). The comms log a step: the gathers flat ZeRO-3 runs over the data
group are split between the two groups with no byte more or less, and the secondary group carries three of the four
passes of every unit but the root (the first forward reads the shards, once a step), exactly; with
``zeroplus.node_size`` 2 its bytes are the only ones the log counts within a node. Memory: the ledger's
``param`` peak is flat ZeRO-3's plus half of every such unit's values (the secondary copy), nothing of it is live
after the step, and the engine's estimate predicts the ``param`` and ``param_gathered`` peaks exactly. A checkpoint
saved under hpZ loads into flat ZeRO-3 over the same ranks with every weight it saved. With qwZ's
int8 gathers beside it (``zero_quantized_weights``), the copy holds the dequantized values: again the flat run's
losses and masters bit for bit. Refused on
every rank, naming the key, the value and the rank: stage 2, a size not dividing the data ranks, hpZ beside MiCS.
"""
from __future__ import annotations

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, initialize_says
from zeroplus.ledger import Category
from zeroplus.parallel import reset_parallel

STEPS, GAS, MICRO, LR, CLIP = 3, 2, 2, 1e-2, 0.5


def _config(hpz: int, stage: int = 3, mics: int = -1, quantized: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "zero_hpz_partition_size": hpz, "mics_shard_size": mics,
                                  "zero_quantized_weights": quantized,
                                  "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
            "comms_logger": {"enabled": True},
            "zeroplus": {"log_level": "warning", "memory_estimate": True, "node_size": 2}}


def _run(hpz: int, quantized: bool = False, root: str | None = None) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(hpz, quantized=quantized))
    batches = make_batches(STEPS * GAS * world, MICRO)
    losses = engine_train(engine, batches, 1, rank, world, GAS)
    engine.comms_log.reset()  # (the first step's one-off collectives stay out of the count)
    losses += engine_train(engine, batches, STEPS - 1, rank, world, GAS, start=1)
    assert engine.budget is not None
    blocks = [g for u in engine.partition.units if not u.is_root for g in u.all_groups]
    result = {"losses": losses, "norm": engine.get_global_grad_norm(),
              "masters": torch.cat([g.master_param.detach().reshape(-1) for g in engine.partition.groups]),
              "gathered": {group: engine.comms_log.bytes_by_kind(group).get("all_gather", 0)
                           for group in ("data", "secondary")},
              "links": engine.comms_log.bytes_by_link(),
              "blocks": sum(4 * g.padded_numel for g in blocks),  # fp32 bytes of every unit but the root
              "param": engine.ledger.peak_bytes(Category.PARAM), "param_live": engine.ledger.live_bytes(Category.PARAM),
              "predicted": {c: (engine.ledger.peak_bytes(Category(c)), engine.budget.category_peaks[c])
                            for c in ("param", "param_gathered")}}
    if root is not None:  # saved under hpZ, loaded by flat ZeRO-3 over the same ranks
        engine.save_checkpoint(root, tag="hpz")
        result["saved"] = engine.consolidated_fp32_state()
    engine.destroy()
    reset_parallel()
    if root is not None:
        torch.manual_seed(1)
        flat = zeroplus.initialize(ParityNet(), _config(1))
        flat.load_checkpoint(root, tag="hpz")
        result["loaded"] = flat.consolidated_fp32_state()
        flat.destroy()
        reset_parallel()
    return result


def _both(root: str) -> list[dict]:
    return [_run(1), _run(2, root=root), _run(1, quantized=True), _run(2, quantized=True)]


def test_hpz_trains_flat_zero3s_model_bit_for_bit_with_backward_gathers_within_the_node(tmp_path):
    steps = STEPS - 1
    for rank, (flat, hpz, flat_qwz, hpz_qwz) in enumerate(run_distributed(_both, 4, str(tmp_path))):
        assert hpz["saved"] and all(torch.equal(hpz["loaded"][n], v) for n, v in hpz["saved"].items()), rank
        # with qwZ the copy holds the dequantized values the forward computed with: the same run again
        assert hpz_qwz["losses"] == flat_qwz["losses"] != flat["losses"], rank
        assert torch.equal(hpz_qwz["masters"], flat_qwz["masters"]), rank
        assert hpz["losses"] == flat["losses"], rank
        assert hpz["norm"] == flat["norm"], rank
        assert torch.equal(hpz["masters"], flat["masters"]), rank
        assert flat["gathered"]["secondary"] == 0, flat["gathered"]
        assert hpz["gathered"]["data"] + hpz["gathered"]["secondary"] == flat["gathered"]["data"], (rank, hpz, flat)
        # per step: the second micro-batch's forward and both backwards of every unit but the root, from the node
        assert hpz["gathered"]["secondary"] == steps * (2 * GAS - 1) * hpz["blocks"], (rank, hpz["gathered"])
        # (zeroplus.node_size 2: ranks 0-1 and 2-3 are nodes) the secondary group's gathers stay on the node
        assert flat["links"]["intra_node"] == 0 and hpz["links"]["intra_node"] == hpz["gathered"]["secondary"], \
            (rank, flat["links"], hpz["links"])
        assert hpz["links"]["inter_node"] == flat["links"]["inter_node"] - hpz["gathered"]["secondary"], rank
        assert hpz["param"] - flat["param"] == hpz["blocks"] // 2, (rank, hpz["param"], flat["param"])
        assert hpz["param_live"] == flat["param_live"], rank
        for result in (flat, hpz):
            assert all(measured == predicted for measured, predicted in result["predicted"].values()), \
                (rank, result["predicted"])


REFUSED = [((2, 2, -1), "ZeRO stage 2 gathers no parameters"),
           ((3, 3, -1), "zero_hpz_partition_size 3: the ranks of a node's secondary copy, at least 2, dividing the "
                        "data-parallel size 4"),
           ((3, 2, 2), "zero_hpz_partition_size 2 with mics_shard_size 2 is not supported yet")]


def _refused() -> list[str]:
    return initialize_says(ParityNet, [_config(hpz, stage, mics) for (stage, hpz, mics), _ in REFUSED])


def test_what_hpz_cannot_run_is_refused_on_every_rank():
    for rank, said in enumerate(run_distributed(_refused, 4)):
        for (case, message), line in zip(REFUSED, said):
            assert message in line and f"rank {rank}" in line, (rank, case, line)
