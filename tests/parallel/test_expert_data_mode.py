"""The expert-data mode on 4 CPU ranks: tensor parallelism in attention, experts whole over data x tensor.

data x tensor = 2 x 2 with ``experts_span_tensor`` and expert size 4: every rank holds 1 of each block's 4
experts, and each tensor rank routes half of the tokens its tensor group shares (``parallel/expert_tokens.py``).
The reference is the plain GPT with all 4 experts in one process and ``torch.optim.AdamW`` on both data ranks'
micro-batches (each loss / 2, the balancing loss weighted alike), clipped at a norm the gradients exceed. The
capacity factor keeps every choice (capacity = k x tokens), since a capacity over 1/T of the tokens drops other
tokens than one over all. Checked per case (ZeRO stage 0-3, sequence parallelism): every rank's losses, the global
gradient norm (an expert counted twice, or a router gradient not summed over the tensor ranks, changes it), and
each rank's experts (by global index), router and norms after 3 steps. The layout it refines, experts over data
ranks only and replicated on both tensor ranks (expert size 2), is checked the same way. ``zeroplus.estimate``
predicts the model-state peaks of ranks 0 and 1 exactly (data rank 1's ranks hold the same shapes). A checkpoint
resumes bit-exact. Refused: sizes that do not tile data x tensor, sequence parallelism with replicated experts,
tokens that do not split over the tensor ranks, and a checkpoint saved in the other layout.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks
from tests.reference import clip_global_norm, engine_train
from zeroplus.budget.virtual_group import VirtualGroup
from zeroplus.models import GPT, gpt_config
from zeroplus.models.gpt_tp import TensorParallelGPT
from zeroplus.parallel.expert_tokens import TokenSplit
from zeroplus.parallel.groups import SingleRank
from zeroplus.parallel.moe import set_aux_grad_scale
from zeroplus.parallel.topology import Topology

STEPS, MICRO, SEQ, CLIP, LR, EXPERTS, DATA = 3, 2, 16, 0.5, 1e-2, 4, 2
# (ZeRO stage, sequence parallel, expert size, experts_span_tensor)
CASES = [(0, False, 4, True), (1, False, 4, True), (2, True, 4, True), (3, False, 4, True), (2, False, 2, False)]


def _gpt_config():
    return gpt_config("tiny", block_size=SEQ, moe_experts=EXPERTS, moe_k=2, moe_capacity_factor=float(EXPERTS))


def _dense() -> GPT:
    torch.manual_seed(0)
    return GPT(_gpt_config(), expert_group=SingleRank())


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (MICRO, SEQ), generator=g), torch.randint(0, 256, (MICRO, SEQ), generator=g))
            for _ in range(STEPS * DATA)]


def _config(stage: int, sp: bool, expert: int, span: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000,
                                  "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning",
                         "parallel": {"tensor": 2, "expert": expert, "experts_span_tensor": span,
                                      "sequence_parallel": sp}}}


def _global(name: str, first: int) -> str:
    """``blocks.0.mlp.moe.experts.0.fc.weight@ep3`` on a rank whose first expert is 3 -> ``...experts.3...``."""
    name = name.split("@ep")[0]
    if ".experts." not in name:
        return name
    head, rest = name.split(".experts.")
    index, tail = rest.split(".", 1)
    return f"{head}.experts.{first + int(index)}.{tail}"


def _job() -> list:
    results = []
    for stage, sp, expert, span in CASES:
        cfg = _config(stage, sp, expert, span)
        zeroplus.parallel.reset_parallel()
        parallel = zeroplus.init_parallel(cfg)
        model = TensorParallelGPT.from_dense(_dense(), sequence_parallel=sp)
        first = model.blocks[0].mlp.moe.first_expert
        engine = zeroplus.initialize(model, cfg)
        norms: list[float] = []
        losses = engine_train(engine, _batches(), STEPS, parallel.data.rank, DATA, 1,
                              on_step=lambda: norms.append(engine.get_global_grad_norm()))
        params = {}
        for g in engine.partition.groups:  # experts, router and norms: whole on this rank
            full = g.gather_master()
            for name, offset, shape in zip(g.names, g.offsets, g.shapes):
                if ".moe." in name or ".ln" in name:
                    params[_global(name, first)] = full[offset:offset + shape.numel()].view(shape).clone()
        results.append({"losses": losses, "norms": norms, "params": params, "data_rank": parallel.data.rank,
                        "ledger": ledger_peaks(engine), "engine_predicted": engine.budget.category_peaks,
                        "expert_group": engine.parallel.ranks["expert"]})
        engine.destroy()
    return results


def _layouts_job(path: str) -> tuple[list[float], list[float], str]:
    """Expert-data mode (expert 4): 2 steps, a checkpoint, a third step; a new engine loads it and takes the
    third step. Then expert size 2 either way: saved with the groups drawn from data x tensor, loaded with them
    drawn from data ranks."""
    cfg = _config(2, False, 4, True)
    parallel = zeroplus.init_parallel(cfg)
    engine = zeroplus.initialize(TensorParallelGPT.from_dense(_dense()), cfg)
    engine_train(engine, _batches(), 2, parallel.data.rank, DATA, 1)
    engine.save_checkpoint(path + "-span")
    straight = engine_train(engine, _batches(), 1, parallel.data.rank, DATA, 1, start=2)
    engine.destroy()
    engine = zeroplus.initialize(TensorParallelGPT.from_dense(_dense()), cfg)
    engine.load_checkpoint(path + "-span")
    resumed = engine_train(engine, _batches(), 1, parallel.data.rank, DATA, 1, start=2)
    engine.destroy()
    engines = []
    for span in (True, False):
        cfg = _config(2, False, 2, span)
        zeroplus.parallel.reset_parallel()
        zeroplus.init_parallel(cfg)
        engines.append(zeroplus.initialize(TensorParallelGPT.from_dense(_dense()), cfg))
        if span:
            engines[0].save_checkpoint(path)
            engines[0].destroy()
    with pytest.raises(ValueError) as refused:
        engines[1].load_checkpoint(path)
    return straight, resumed, str(refused.value)


def _reference() -> tuple[list[list[float]], list[float], dict[str, torch.Tensor]]:
    model, batches = _dense(), _batches()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses: list[list[float]] = [[] for _ in range(DATA)]
    norms = []
    set_aux_grad_scale(1.0 / DATA)
    try:
        for s in range(STEPS):
            for r in range(DATA):
                x, y = batches[s * DATA + r]
                loss = model(x, y)
                (loss / DATA).backward()
                losses[r].append(loss.item())
            norms.append(clip_global_norm(list(model.parameters()), CLIP))
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        set_aux_grad_scale(1.0)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_expert_data_mode_matches_all_experts_in_one_process():
    ranks = run_distributed(_job, 4, timeout=600)
    ref_losses, ref_norms, ref_params = _reference()
    assert ref_norms[0] > CLIP, "the clip must act, or the norm is not tested"
    for i, case in enumerate(CASES):
        held: set[str] = set()
        for rank, results in enumerate(ranks):
            got, where = results[i], f"case {case}, rank {rank}"
            if case[3]:
                assert got["expert_group"] == [0, 1, 2, 3], f"{where}: the expert group spans data x tensor"
            assert got["losses"] == pytest.approx(ref_losses[got["data_rank"]], rel=2e-5), f"{where}: losses"
            assert got["norms"] == pytest.approx(ref_norms, rel=2e-5), f"{where}: grad norms"
            for name, value in got["params"].items():
                torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=LR / 10,
                                           msg=lambda m, n=name: f"{where}, {n}: {m}")
            held |= set(got["params"])
            if rank >= 2:  # data rank 1 holds the same shapes as data rank 0
                continue
            stage, sp, expert, span = case
            budget = zeroplus.estimate(lambda sp=sp: TensorParallelGPT(_gpt_config(), sequence_parallel=sp),
                                       _config(stage, sp, expert, span), world_size=4, rank=rank, seq_len=SEQ)
            assert_model_states_predicted(got["ledger"], where, estimate=budget.category_peaks,
                                          engine=got["engine_predicted"])
        experts = {n for n in ref_params if ".experts." in n}
        assert experts <= held, f"case {case}: the ranks together hold every expert"


def test_checkpoints_resume_in_the_expert_data_mode_and_refuse_the_other_layout(tmp_path):
    for straight, resumed, message in run_distributed(_layouts_job, 4, str(tmp_path / "ckpt")):
        assert straight == resumed, "resumed from the checkpoint, the third step's loss differs"
        assert "expert groups drawn from data x tensor (experts_span_tensor)" in message, message
        assert "has them drawn from data ranks" in message, message


def test_sequence_parallel_with_replicated_experts_is_refused():
    with pytest.raises(ValueError, match="tensor size 2 with sequence parallelism needs zeroplus.parallel"):
        TensorParallelGPT(_gpt_config(), sequence_parallel=True, tp=VirtualGroup(0, 2))


@pytest.mark.parametrize("sizes, message", [
    (dict(world_size=8, tensor=2, expert=3), "expert size 3 must be a multiple of tensor size 2 and divide 8"),
    (dict(world_size=4, tensor=2, expert=8), "expert size 8 must be a multiple of tensor size 2 and divide 4"),
    (dict(world_size=4, tensor=1, expert=2, context=2), "context size 2 with expert size 2 is not supported"),
])
def test_sizes_that_do_not_tile_data_x_tensor_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message):
        Topology(**sizes, experts_span_tensor=True)


def test_groups_of_the_expert_data_mode():
    top = Topology(8, tensor=2, expert=4, experts_span_tensor=True)
    assert top.groups("expert") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert top.groups("expert_data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [top.coordinates(r).expert for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert "expert 4 over data x tensor (expert-data 2)" in top.describe()
    for e, members in enumerate(top.groups("expert_data")):  # one tensor rank each: one checkpoint slice
        assert {top.coordinates(r).tensor for r in members} == {e % 2}


def test_tokens_that_do_not_split_over_the_tensor_ranks_are_refused():
    split = TokenSplit(VirtualGroup(1, 2))
    with pytest.raises(ValueError, match="tensor rank 1: the layer's 5 tokens do not split into 2"):
        split.enter(torch.zeros(5, 4))
    assert split.enter(torch.arange(8.0).view(4, 2)).tolist() == [[4.0, 5.0], [6.0, 7.0]]
