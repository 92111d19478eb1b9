"""MiCS, hpZ and MiCS's two-level gather beside context parallelism: 4 gloo ranks as data 2 x context 2 (Ulysses, the
built-in GPT), ``zeroplus.node_size`` 2, so each node holds the two context ranks of one data rank (a zero group's
ranks are data x context, context the faster; see note: nodes beside tensor).

- Flat ZeRO-3 over the 4 zero ranks equals the plain GPT on the 2 data ranks' batches with SGD, clipped
  (``test_context_parallel``'s reference and tolerances).
- MiCS (``mics_shard_size`` 2: shard groups within a node, replicas across) at stages 1 and 3: each flat group
  partitioned over 2 ranks, the replicas' masters bit for bit equal, the losses of flat ZeRO-3 within 1e-6 and the
  masters within fp32 tolerance (the four ranks' gradients are summed in another order); the engine's estimate
  predicts each model-state peak the ledger measures.
- hpZ (``zero_hpz_partition_size`` 2) and MiCS's hierarchical gather (one shard group of 4 over 2 nodes): flat
  ZeRO-3's losses, gradient norms and masters bit for bit; hpZ's secondary group carries gathers, all within the node.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks
from tests.parallel.test_context_parallel import CLIP, LR, MICRO, STEPS, _batches, _model, _reference
from tests.zero.test_nodes_beside_tensor import CASES, assert_hpz_and_two_level_are_flat  # (the same layouts)
from zeroplus.parallel import reset_parallel

DATA, CONTEXT = 2, 2


def _config(stage: int, zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0} | zero,
            "comms_logger": {"enabled": True},
            "zeroplus": {"log_level": "warning", "memory_estimate": True, "node_size": 2,
                         "parallel": {"context": CONTEXT}}}


def _job() -> dict[str, dict]:
    out = {}
    for case, (stage, zero) in CASES.items():
        cfg = _config(stage, zero)
        parallel = zeroplus.init_parallel(cfg)
        engine = zeroplus.initialize(_model(), cfg)
        batches, d = _batches(DATA), parallel.coordinates.data
        losses, norms = [], []
        for s in range(STEPS):
            if s == 1:
                engine.comms_log.reset()  # (the first step's one-off collectives stay out of the count)
            x, y = batches[s * DATA + d]  # every rank of a context group: the same whole sequences
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            norms.append(engine.get_global_grad_norm())
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses.append(total.item() / (DATA * CONTEXT))
        assert engine.budget is not None
        out[case] = {"losses": losses, "norms": norms, "state": engine.consolidated_fp32_state(),
                     "topology": parallel.topology,
                     "shards": {g.dp.size for g in engine.partition.groups},
                     "masters": torch.cat([g.master_param.detach().reshape(-1) for g in engine.partition.groups]),
                     "gathered": {group: engine.comms_log.bytes_by_kind(group).get("all_gather", 0)
                                  for group in ("zero", "secondary")},  # (zero: data x context)
                     "links": engine.comms_log.bytes_by_link(),
                     "ledger": ledger_peaks(engine), "predicted": engine.budget.category_peaks}
        engine.destroy()
        reset_parallel()
    return out


def _close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str, rtol: float) -> None:
    for name, value in expected.items():
        floor = rtol * value.abs().max().item()
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=floor, msg=lambda m, n=name: f"{where} {n}: {m}")


def test_mics_and_hpz_beside_context_parallelism_train_flat_zero3s_model():
    ranks = run_distributed(_job, DATA * CONTEXT)
    ref_losses, ref_state = _reference(DATA)
    for rank, runs in enumerate(ranks):
        flat = runs["flat"]
        assert flat["losses"] == pytest.approx(ref_losses, rel=1e-5), rank
        _close(flat["state"], ref_state, f"rank {rank} flat", 1e-5)
        for case in ("mics 1", "mics 3"):
            run, where = runs[case], f"rank {rank} {case}"
            assert run["topology"].shard == 2 and run["topology"].replicas == 2 and run["shards"] == {2}, where
            assert run["losses"] == pytest.approx(flat["losses"], rel=1e-6), where
            _close(run["state"], flat["state"], where, 1e-5)
            assert_model_states_predicted(run["ledger"], where, engine=run["predicted"])
        # the secondary group (the context ranks of one data rank: global ranks 2d, 2d + 1) is on a node; the zero
        # group (data x context) is the comms log's "zero"
        assert_hpz_and_two_level_are_flat(runs, rank, "zero")
    for case in ("mics 1", "mics 3"):  # replicas: zero ranks z and z + 2, global r and r + 2
        for a in range(2):
            assert torch.equal(ranks[a][case]["masters"], ranks[a + 2][case]["masters"]), (case, a)
