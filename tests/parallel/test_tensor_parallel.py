"""Tensor parallelism with ZeRO on 4 CPU ranks, data x tensor = 2 x 2, against the single-process GPT.

Each rank builds the built-in GPT from the same seed, takes its tensor slices
(``TensorParallelGPT.from_dense``) and trains 4 steps with ZeRO over its data group; the reference
is the plain GPT with ``torch.optim.AdamW`` on both data ranks' batches, clipped at a norm the
gradients exceed (so a norm that counted the replicated norms and biases twice would change every
update). Checked per case: the losses rank 0 reports, the global gradient norm, and every
parameter slice after training, within fp32 tolerance; the overlapped sequence-parallel path
(2 chunks) equal to the plain one (1 chunk), bit for bit. A failure names the case (ZeRO stage,
sequence parallel, chunks) and the parameter. ``zeroplus.estimate`` for each rank of the topology
predicts the model-state peaks the engine's ledger measured, exactly. A checkpoint resumes bit-exact
at 2 x 2 and is refused at tensor 1.
"""
from __future__ import annotations

import json

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks, local_params
from tests.reference import clip_global_norm, engine_train
from zeroplus.engine.checkpoints.hf_export import export_checkpoint
from zeroplus.models import GPT, gpt_config
from zeroplus.models.gpt_tp import TensorParallelGPT

STEPS, MICRO, SEQ, CLIP, LR = 4, 2, 16, 0.5, 1e-2
CASES = [(1, False, 1), (2, True, 1), (3, True, 1), (3, True, 2)]


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", block_size=SEQ))


def _batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (MICRO, SEQ), generator=g), torch.randint(0, 256, (MICRO, SEQ), generator=g))
            for _ in range(n)]


def _config(stage: int, sp: bool, chunks: int, estimate: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": estimate,
                         "parallel": {"tensor": 2, "sequence_parallel": sp, "overlap_chunks": chunks}}}


def _tp_job() -> list:
    results = []
    for stage, sp, chunks in CASES:
        cfg = _config(stage, sp, chunks, estimate=True)
        parallel = zeroplus.init_parallel(cfg)
        engine = zeroplus.initialize(TensorParallelGPT.from_dense(_gpt(), sequence_parallel=sp,
                                                                  overlap_chunks=chunks), cfg)
        norms = []
        losses = engine_train(engine, _batches(2 * STEPS), STEPS, parallel.data.rank, 2, 1,
                              on_step=lambda: norms.append(engine.get_global_grad_norm()))
        results.append({"losses": losses, "norms": norms, "params": local_params(engine),
                        "tensor_rank": parallel.tensor.rank,
                        "ledger": ledger_peaks(engine),
                        "engine_predicted": engine.budget.category_peaks})
        engine.destroy()
    return results


def _reference(data: int = 2, steps: int = STEPS) -> tuple[list[list[float]], list[float], GPT]:
    """Losses per data rank, the global gradient norm per step (float64 sum, as the engine computes it,
    before clipping) and the trained model: the plain GPT on the ``data`` data ranks' batches with AdamW."""
    model, batches = _gpt(), _batches(data * steps)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses: list[list[float]] = [[] for _ in range(data)]
    norms = []
    for s in range(steps):
        for r in range(data):
            x, y = batches[s * data + r]
            loss = model(x, y)
            (loss / data).backward()
            losses[r].append(loss.item())
        norms.append(clip_global_norm(list(model.parameters()), CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, model


def _expected_slices(dense: GPT, tensor_rank: int) -> dict[str, torch.Tensor]:
    class _Rank:  # the slicing from_dense does, for a given tensor rank, without a process group
        size, rank = 2, tensor_rank
    sliced = TensorParallelGPT.from_dense(dense, tp=_Rank())
    return {n: p.detach() for n, p in sliced.named_parameters()}


def test_data_x_tensor_parallel_matches_the_single_process_model():
    ranks = run_distributed(_tp_job, 4)
    ref_losses, ref_norms, dense = _reference()
    assert ref_norms[0] > CLIP, "the clip must act, or the norm is not tested"
    for i, case in enumerate(CASES):
        for rank, results in enumerate(ranks):
            got = results[i]
            expected_losses = ref_losses[rank // 2]  # ranks 0, 1: data rank 0; ranks 2, 3: data rank 1
            assert got["losses"] == pytest.approx(expected_losses, rel=2e-5), \
                f"case {case}, rank {rank}: losses {got['losses']} != reference {expected_losses}"
            assert got["norms"] == pytest.approx(ref_norms, rel=2e-5), f"case {case}, rank {rank}: grad norms"
            expected = _expected_slices(dense, got["tensor_rank"])
            for name, value in expected.items():
                # Adam divides each gradient by its own root mean square, so where a gradient is rounding
                # noise (rows of bytes the batches never use) rounding picks its update: lr / 10 absolute
                torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=LR / 10,
                                           msg=lambda m, n=name: f"case {case}, rank {rank}, {n}: {m}")
            if rank < 2:  # data rank 1 holds the same shapes
                _check_estimate(got["ledger"], got["engine_predicted"], case, rank)
    plain, overlapped = CASES.index((3, True, 1)), CASES.index((3, True, 2))
    for rank, results in enumerate(ranks):
        assert results[plain]["losses"] == results[overlapped]["losses"], f"rank {rank}: overlap changed the losses"
        for name, value in results[plain]["params"].items():
            assert torch.equal(value, results[overlapped]["params"][name]), f"rank {rank}: overlap changed {name}"


def _check_estimate(measured: dict[str, int], engine_predicted: dict[str, int], case: tuple, rank: int) -> None:
    """``zeroplus.estimate`` of this rank (its tensor slice, partitioned over its data group of 2), and the
    engine's own prediction at its first forward, give the model-state peaks the ledger measured exactly."""
    stage, sp, chunks = case
    budget = zeroplus.estimate(lambda: TensorParallelGPT(gpt_config("tiny", block_size=SEQ), sequence_parallel=sp,
                                                         overlap_chunks=chunks),
                               _config(stage, sp, chunks), world_size=4, rank=rank, seq_len=SEQ)
    assert_model_states_predicted(measured, f"case {case}, rank {rank}", estimate=budget.category_peaks,
                                  engine=engine_predicted)


def _tp_engine(tensor: int):
    cfg = _config(2, True, 1)
    cfg["zeroplus"]["parallel"]["tensor"] = tensor
    parallel = zeroplus.init_parallel(cfg)
    return zeroplus.initialize(TensorParallelGPT.from_dense(_gpt(), sequence_parallel=True), cfg), parallel


def _save_resume(path: str) -> dict:
    """At data x tensor = 2 x 2: train 2 steps, save, train 2 more; a new engine loads the save and trains
    the same 2; then at data 4 x tensor 1 loading is refused."""
    batches = _batches(2 * STEPS)
    engine, parallel = _tp_engine(2)
    straight = engine_train(engine, batches, 2, parallel.data.rank, 2, 1)
    engine.save_checkpoint(path)
    straight += engine_train(engine, batches, 2, parallel.data.rank, 2, 1, start=2)
    engine.destroy()
    engine, _ = _tp_engine(2)
    engine.load_checkpoint(path)
    resumed = engine_train(engine, batches, 2, parallel.data.rank, 2, 1, start=2)
    engine.destroy()
    zeroplus.parallel.reset_parallel()
    engine, _ = _tp_engine(1)
    with pytest.raises(ValueError) as refused:
        engine.load_checkpoint(path)
    return {"straight": straight, "resumed": resumed, "error": str(refused.value)}


def test_tensor_parallel_checkpoint_resumes_and_refuses_another_tensor_size(tmp_path):
    path = str(tmp_path / "ckpt")
    ranks = run_distributed(_save_resume, 4, path)
    with open(f"{path}/latest") as f:
        meta = json.load(open(f"{path}/{f.read()}/metadata.json"))
    assert meta["topology"]["tensor"] == 2 and meta["parts"] == ["tp00_pp00", "tp01_pp00"]
    for rank, got in enumerate(ranks):
        assert got["resumed"] == got["straight"][2:], f"rank {rank}: resume is not bit-exact"
        assert "saved with tensor 2 x pipeline 1" in got["error"] and "tensor 1 x pipeline 1" in got["error"], got
    for convert in (zeroplus.load_fp32_state_dict, lambda p: export_checkpoint(p, str(tmp_path / "hf"))):
        with pytest.raises(ValueError, match="does not record how its model was cut"):  # (own layers: no names)
            convert(path)


def _partitioned(partition: bool) -> dict:
    cfg = _config(1, False, 1)
    cfg["activation_checkpointing"] = {"partition_activations": partition}
    zeroplus.init_parallel(cfg)
    dense = _gpt()
    dense.config.checkpoint_blocks = True
    engine = zeroplus.initialize(TensorParallelGPT.from_dense(dense), cfg)
    losses = engine_train(engine, _batches(STEPS), STEPS, 0, 1, 1)
    kept = engine.memory_report().saved.get("partition_activations/activation", {}).get("peak_bytes", 0)
    out = {"losses": losses, "params": local_params(engine), "not_held": kept}
    engine.destroy()
    return out


def _partitioned_off_and_on() -> list[dict]:
    return [_partitioned(False), _partitioned(True)]


def test_partition_activations_keeps_half_of_each_checkpointed_input_per_tensor_rank():
    off, on = (list(runs) for runs in zip(*run_distributed(_partitioned_off_and_on, 2)))
    # each block's input is (seq, micro, dim) fp32, whole on both tensor ranks: each keeps half
    per_input = SEQ * MICRO * gpt_config("tiny").n_embd * 4
    for rank in range(2):
        assert on[rank]["losses"] == off[rank]["losses"], f"rank {rank}: partitioning changed the losses"
        for name, value in on[rank]["params"].items():
            assert torch.equal(value, off[rank]["params"][name]), f"rank {rank}: partitioning changed {name}"
        assert on[rank]["not_held"] == gpt_config("tiny").n_layer * per_input // 2 and off[rank]["not_held"] == 0
