"""MiCS, hpZ and MiCS's two-level gather beside tensor parallelism: 8 gloo ranks as data 4 x tensor 2 (the built-in
GPT split by ``TensorParallelGPT.from_dense``, sequence parallel), ``zeroplus.node_size`` 4, so each node holds 2 data
ranks of each tensor rank (tensor ranks are the fastest; see note: nodes beside tensor).

- Flat ZeRO-3 over each tensor rank's 4 data ranks equals the plain GPT on the 4 data ranks' batches with AdamW,
  clipped (losses, gradient norms, every slice; ``test_tensor_parallel``'s tolerances).
- MiCS (``mics_shard_size`` 2) at stages 1 and 3: each flat group partitioned over 2 data ranks, the replicas' masters
  bit for bit equal, the losses and norms of flat ZeRO-3 within 1e-6 and the slices within ``test_tensor_parallel``'s
  tolerance (the four data ranks' gradients are summed in another order); the engine's estimate predicts each
  model-state peak the ledger measures.
- hpZ (``zero_hpz_partition_size`` 2) and MiCS's hierarchical gather (shard groups of 4 over 2 nodes): flat ZeRO-3's
  losses, norms and slices bit for bit; hpZ's secondary group carries gathers, all within the node, and the data
  group's gathers and the secondary's add up to flat ZeRO-3's; the two-level gather runs over nodes of 2 data ranks.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks, local_params
from tests.parallel.test_tensor_parallel import CLIP, LR, MICRO, _batches, _expected_slices, _gpt, _reference
from tests.reference import engine_train
from zeroplus.models.gpt_tp import TensorParallelGPT
from zeroplus.parallel import reset_parallel

STEPS, DATA = 3, 4
CASES = {"flat": (3, {}), "mics 1": (1, {"mics_shard_size": 2}), "mics 3": (3, {"mics_shard_size": 2}),
         "hpz": (3, {"zero_hpz_partition_size": 2}),
         "two-level": (3, {"mics_shard_size": 4, "mics_hierarchical_params_gather": True})}


def _config(stage: int, zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  "stage3_param_persistence_threshold": 0} | zero,
            "comms_logger": {"enabled": True},
            "zeroplus": {"log_level": "warning", "memory_estimate": True, "node_size": 4,
                         "parallel": {"tensor": 2, "sequence_parallel": True}}}


def _job() -> dict[str, dict]:
    out = {}
    for case, (stage, zero) in CASES.items():
        cfg = _config(stage, zero)
        parallel = zeroplus.init_parallel(cfg)
        engine = zeroplus.initialize(TensorParallelGPT.from_dense(_gpt(), sequence_parallel=True), cfg)
        norms: list[float] = []
        batches = _batches(DATA * STEPS)
        losses = engine_train(engine, batches, 1, parallel.data.rank, DATA, 1,
                              on_step=lambda: norms.append(engine.get_global_grad_norm()))
        engine.comms_log.reset()  # (the first step's one-off collectives stay out of the count)
        losses += engine_train(engine, batches, STEPS - 1, parallel.data.rank, DATA, 1, start=1,
                               on_step=lambda: norms.append(engine.get_global_grad_norm()))
        assert engine.budget is not None
        out[case] = {"losses": losses, "norms": norms, "params": local_params(engine),
                     "tensor_rank": parallel.tensor.rank, "data_rank": parallel.data.rank,
                     "topology": parallel.topology,
                     "shards": {g.dp.size for g in engine.partition.groups},
                     "masters": torch.cat([g.master_param.detach().reshape(-1) for g in engine.partition.groups]),
                     "gathered": {group: engine.comms_log.bytes_by_kind(group).get("all_gather", 0)
                                  for group in ("data", "secondary")},
                     "links": engine.comms_log.bytes_by_link(),
                     "ledger": ledger_peaks(engine), "predicted": engine.budget.category_peaks}
        engine.destroy()
        reset_parallel()
    return out


def _close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    # (Adam divides each gradient by its own root mean square: where a gradient is rounding noise, rounding picks its
    # update, hence lr / 10 absolute, as test_tensor_parallel)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=LR / 10, msg=lambda m, n=name: f"{where} {n}: {m}")


def assert_hpz_and_two_level_are_flat(runs: dict[str, dict], rank: int, zero_group: str) -> None:
    """hpZ over 2 and the two-level gather over nodes of 2: flat ZeRO-3's losses, norms and masters bit for bit; hpZ's
    gathers split between ``zero_group`` (the comms log's name of the group ZeRO shards over) and the secondary group
    with no byte more or less, the secondary's all within the node."""
    flat = runs["flat"]
    for case in ("hpz", "two-level"):
        run, where = runs[case], f"rank {rank} {case}"
        assert run["losses"] == flat["losses"] and run["norms"] == flat["norms"], where
        assert torch.equal(run["masters"], flat["masters"]), where
    hpz, two = runs["hpz"], runs["two-level"]
    assert hpz["topology"].secondary == 2 and two["topology"].node == 2, (rank, hpz["topology"], two["topology"])
    assert flat["gathered"]["secondary"] == 0 < hpz["gathered"]["secondary"], (rank, hpz["gathered"])
    assert hpz["gathered"][zero_group] + hpz["gathered"]["secondary"] == flat["gathered"][zero_group], (rank, hpz, flat)
    assert hpz["links"]["inter_node"] == flat["links"]["inter_node"] - hpz["gathered"]["secondary"], rank


def test_mics_and_hpz_beside_tensor_parallelism_train_flat_zero3s_model():
    ranks = run_distributed(_job, 2 * DATA)
    ref_losses, ref_norms, dense = _reference(DATA, STEPS)
    assert ref_norms[0] > CLIP, "the clip must act, or the norm is not tested"
    for rank, runs in enumerate(ranks):
        flat = runs["flat"]
        assert flat["losses"] == pytest.approx(ref_losses[flat["data_rank"]], rel=2e-5), rank
        assert flat["norms"] == pytest.approx(ref_norms, rel=2e-5), rank
        _close(flat["params"], _expected_slices(dense, flat["tensor_rank"]), f"rank {rank} flat")
        for case in ("mics 1", "mics 3"):
            run, where = runs[case], f"rank {rank} {case}"
            assert run["topology"].shard == 2 and run["topology"].replicas == 2 and run["shards"] == {2}, where
            assert run["losses"] == pytest.approx(flat["losses"], rel=1e-6), where
            assert run["norms"] == pytest.approx(flat["norms"], rel=1e-6), where
            _close(run["params"], flat["params"], where)
            assert_model_states_predicted(run["ledger"], where, engine=run["predicted"])
        # the secondary group (data ranks 2n, 2n + 1 of one tensor rank: global ranks 4n + t, 4n + 2 + t) is on a node
        assert_hpz_and_two_level_are_flat(runs, rank, "data")
    for case in ("mics 1", "mics 3"):  # replicas: data ranks d and d + 2 of one tensor rank, global r and r + 4
        for a in range(4):
            assert torch.equal(ranks[a][case]["masters"], ranks[a + 4][case]["masters"]), (case, a)
