"""MiCS's hierarchical gather (``zero_optimization.mics_hierarchical_params_gather``): the parameters' gathers over a
shard group that spans nodes run in two levels, across the nodes among the ranks at one place in each, then within
each node (``zero/two_level_gather.py``; see note: mics hierarchical gather).

4 gloo ranks as 2 simulated nodes of 2 (``zeroplus.node_size`` 2), one shard group of all 4 (``mics_shard_size`` 4,
as DeepSpeed's MiCS takes it), ``ParityNet`` with accumulation 2 and binding clipping, at stage 3 (every forward's and
backward's gathers), stage 3 with qwZ's int8 codes (``zero_quantized_weights``: codes and scales in the same two
levels) and stage 1 (the gathers after the step), each against the same config gathering in one level: the
losses, the global gradient norm and every master shard bit for bit (the gathers copy the same values). The comms log
a step: the gathers' bytes across nodes are half of the one-level run's (one rank of each node receives each part
from another node instead of both), to the byte, and what they no longer send across is sent within the nodes (twice
the across bytes: each node rank gathers both nodes' parts). Memory: the engine's estimate predicts the
``comm_buffer``, ``param`` and ``param_gathered`` peaks exactly (the across level's buffer, held until the second
level lands). Said at initialize: two levels; with nodes of 3 the shard group does not split into whole nodes, so
one level, and a warning; nothing where there is nothing to change (shard groups within a node, nodes of one rank);
without ``mics_shard_size`` the key does nothing, as in DeepSpeed, though qgZ's two levels make node groups (the
gathers stay one level, and initialize says so).
"""
from __future__ import annotations

import logging

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.ledger import Category
from zeroplus.parallel import reset_parallel
from zeroplus.zero.two_level_gather import TwoLevelGather

STEPS, GAS, MICRO, LR, CLIP = 3, 2, 2, 1e-2, 0.5


def _config(stage: int, levels: bool, node: int = 2, quantized: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "mics_shard_size": 4, "mics_hierarchical_params_gather": levels,
                                  "zero_quantized_weights": quantized,
                                  "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
            "comms_logger": {"enabled": True},
            "zeroplus": {"log_level": "warning", "memory_estimate": True, "node_size": node}}


def _run(stage: int, levels: bool, quantized: bool = False) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(stage, levels, quantized=quantized))
    batches = make_batches(STEPS * GAS * world, MICRO)
    losses = engine_train(engine, batches, 1, rank, world, GAS)
    engine.comms_log.reset()  # (the first step's one-off collectives stay out of the count)
    losses += engine_train(engine, batches, STEPS - 1, rank, world, GAS, start=1)
    assert engine.budget is not None
    result = {"losses": losses, "norm": engine.get_global_grad_norm(),
              "masters": torch.cat([g.master_param.detach().reshape(-1) for g in engine.partition.groups]),
              "gathered": {group: engine.comms_log.bytes_by_kind(group).get("all_gather", 0)
                           for group in ("data", "node", "across")},
              "predicted": {c: (engine.ledger.peak_bytes(Category(c)), engine.budget.category_peaks[c])
                            for c in ("comm_buffer", "param", "param_gathered")}}
    engine.destroy()
    reset_parallel()
    return result


def _said(node: int, shard: int, qgz: bool = False) -> tuple[list[str], bool]:
    """What initialize says of the key with nodes of ``node`` ranks and shard groups of ``shard`` (``qgz``: with
    quantized gradients, whose two levels make node groups), and whether its gathers run in two levels."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroplus").addHandler(handler)
    config = _config(3, True, node=node)
    config["zero_optimization"] |= {"mics_shard_size": shard, "zero_quantized_gradients": qgz}
    config["zeroplus"]["log_level"] = "info"
    try:
        engine = zeroplus.initialize(ParityNet(), config)
        two = any(isinstance(g.values_group, TwoLevelGather) for g in engine.partition.groups)
        engine.destroy()
    finally:
        logging.getLogger("zeroplus").removeHandler(handler)
        reset_parallel()
    return [line for line in said if "mics_hierarchical_params_gather" in line], two


def _all() -> list:
    return [_run(stage, levels) for stage in (3, 1) for levels in (False, True)] + \
        [_run(3, levels, quantized=True) for levels in (False, True)] + \
        [[_said(node, shard) for node, shard in ((2, 4), (3, 4), (2, 2), (1, 2))] + [_said(2, -1, qgz=True)]]


def test_the_hierarchical_gather_sends_half_the_bytes_across_nodes_and_trains_the_same_model():
    for rank, (flat3, levels3, flat1, levels1, flat_qwz, levels_qwz, said) in enumerate(run_distributed(_all, 4)):
        assert flat_qwz["losses"] != flat3["losses"], rank  # (qwZ's codes: another run, gathered the same two ways)
        for stage, flat, levels in ((3, flat3, levels3), (1, flat1, levels1), ("3 qwZ", flat_qwz, levels_qwz)):
            label = (rank, stage)
            assert levels["losses"] == flat["losses"], label
            assert levels["norm"] == flat["norm"], label
            assert torch.equal(levels["masters"], flat["masters"]), label
            assert flat["gathered"]["node"] == flat["gathered"]["across"] == 0, (label, flat["gathered"])
            assert levels["gathered"]["data"] == 0, (label, levels["gathered"])
            # across: each rank receives the other node's part at its place, half of what one level brings across
            assert 2 * levels["gathered"]["across"] == flat["gathered"]["data"] > 0, (label, levels, flat)
            assert levels["gathered"]["node"] == flat["gathered"]["data"], (label, levels["gathered"])
            for result in (flat, levels):
                assert all(measured == predicted for measured, predicted in result["predicted"].values()), \
                    (label, result["predicted"])
        assert levels3["predicted"]["comm_buffer"][0] > flat3["predicted"]["comm_buffer"][0], rank
        # two levels; nodes of 3 do not tile 4: one level; within a node, or nodes of one rank: nothing to change;
        # without mics_shard_size nothing, as in DeepSpeed, though qgZ makes node groups
        (two, in_two), (one_level, in_one), (within, _), (single, _), (unset, unset_two) = said
        assert in_two and not in_one and not unset_two, (rank, said)
        if rank == 0:  # (rank 0 logs)
            assert len(two) == 1 and "two levels" in two[0], two
            assert len(one_level) == 1 and "one level" in one_level[0], one_level
            assert within == single == [], said
            assert len(unset) == 1 and "it does nothing, as in DeepSpeed" in unset[0], unset
