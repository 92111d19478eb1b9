"""The GPT with mixture-of-experts MLPs on 4 CPU ranks, data x expert = 4 x 2, against one process.

Each rank holds 2 of every block's 4 experts (top-2 gating, capacity factor 1: some choices are
dropped); ZeRO partitions dense parameters over the 4 data ranks and expert parameters over the 2
expert-data ranks holding the same experts. The reference is the plain model with all 4 experts in
one process and ``torch.optim.AdamW``, running each rank's micro-batches in turn (capacity and the
balancing loss are per rank's tokens, as on the ranks), each loss divided by 4 x accumulation, with
global-norm clipping. Checked at ZeRO 0-3 (2 micro-batches per step): every rank's losses, the
global gradient norm (which the clipping uses: a wrong expert-gradient scale or a double-counted
expert shard changes it), and every parameter, experts by their global index, after 3 steps. Then
a checkpoint: saved after step 2 at ZeRO 2 and loaded into a new engine at ZeRO 3, step 3 equals the
uninterrupted run; a checkpoint saved by 2 ranks (data 2 x expert 2) loads at 4 ranks to the same
weights; loading with every expert on every rank (expert size 1) is refused. And
``zeroplus.estimate`` for ranks 0 and 1 (expert ranks 0 and 1; ranks 2 and 3 hold the same shapes), and
each engine's own prediction at its first forward, give the model-state peaks (parameters, gathered
parameters, gradients, masters, optimizer states) the engine's ledger measured, exactly.
"""
from __future__ import annotations

import json

import pytest
import torch

import zeroplus
from tests.cli_run import run_cli
from tests.dist_helper import run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks
from tests.reference import clip_global_norm, engine_train
from zeroplus.models import GPT, gpt_config
from zeroplus.parallel.groups import SingleRank
from zeroplus.parallel.moe import set_aux_grad_scale

STEPS, MICRO, SEQ, GAS, CLIP, LR, WORLD, EXPERTS = 3, 2, 16, 2, 0.5, 1e-2, 4, 4
STAGES = [0, 1, 2, 3]


def _gpt_config():
    return gpt_config("tiny", block_size=SEQ, moe_experts=EXPERTS, moe_k=2, moe_capacity_factor=1.0)


def _reference_model() -> GPT:
    torch.manual_seed(0)
    return GPT(_gpt_config(), expert_group=SingleRank())


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (MICRO, SEQ), generator=g), torch.randint(0, 256, (MICRO, SEQ), generator=g))
            for _ in range(STEPS * GAS * WORLD)]


def _config(stage: int, expert: int = 2, predict: bool = True) -> dict:
    """``predict``: the engine's memory estimate at its first forward (off where the test reads no prediction: it
    simulates the run twice, 2-3 s an engine here, most of this test's time)."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000},
            "zeroplus": {"log_level": "warning", "memory_estimate": predict, "parallel": {"expert": expert}}}


def _global_name(name: str, local: int) -> str:
    """``blocks.0.mlp.moe.experts.1.fc.weight@ep1`` -> ``blocks.0.mlp.moe.experts.3.fc.weight``."""
    if "@ep" not in name:
        return name
    name, ep = name.split("@ep")
    head, index, tail = name.partition(".experts.")[0], *name.partition(".experts.")[2].split(".", 1)
    return f"{head}.experts.{int(ep) * local + int(index)}.{tail}"


def _engine_model(expert_rank: int) -> GPT:
    """This rank's model: the reference's weights, its own experts taken by their global index."""
    full = _reference_model().state_dict()
    model = GPT(_gpt_config())
    local = model.blocks[0].mlp.moe.local
    model.load_state_dict({n: full[_global_name(f"{n}@ep{expert_rank}" if ".experts." in n else n, local)]
                           for n in model.state_dict()})
    return model


def _train(engine, batches, data_rank: int, steps: range) -> tuple[list[float], list[float]]:
    norms: list[float] = []
    losses = engine_train(engine, batches, len(steps), data_rank, WORLD, GAS, start=steps.start,
                          on_step=lambda: norms.append(engine.get_global_grad_norm()))
    return losses, norms


def _params(engine, local: int) -> dict[str, torch.Tensor]:
    out = {}
    for g in engine.partition.groups:
        full = g.gather_master()
        for name, offset, shape in zip(g.names, g.offsets, g.shapes):
            out[_global_name(name, local)] = full[offset:offset + shape.numel()].view(shape).clone()
    return out


def _save_at_two_ranks(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Data 2 x expert 2 (one rank per expert-data group): one step, a checkpoint, the weights saved."""
    parallel = zeroplus.init_parallel(_config(2))
    model = _engine_model(parallel.expert.rank)
    engine = zeroplus.initialize(model, _config(2, predict=False))
    _train(engine, _batches(), parallel.data.rank, range(1))
    engine.save_checkpoint(ckpt_dir)
    return _params(engine, model.blocks[0].mlp.moe.local)


def _expert_job(ckpt_dir: str, two_rank_ckpt: str) -> dict:
    results = {}
    batches = _batches()
    for stage in STAGES:
        cfg = _config(stage)
        parallel = zeroplus.init_parallel(cfg)
        model = _engine_model(parallel.expert.rank)
        local = model.blocks[0].mlp.moe.local
        engine = zeroplus.initialize(model, cfg)
        experts = [g for g in engine.partition.groups if g.expert]
        assert experts and all(g.dp.size == 2 for g in experts), "expert groups partition over expert-data (2)"
        assert all(g.dp.size == 4 for g in engine.partition.groups if not g.expert)
        losses, norms = _train(engine, batches, parallel.data.rank, range(STEPS))
        results[stage] = {"losses": losses, "norms": norms, "params": _params(engine, local),
                          "ledger": ledger_peaks(engine),
                          "engine_predicted": engine.budget.category_peaks}
        engine.destroy()
    # checkpoint: save after step 2 at ZeRO 2, resume at ZeRO 3 for step 3
    parallel = zeroplus.init_parallel(_config(2))
    engine = zeroplus.initialize(_engine_model(parallel.expert.rank), _config(2, predict=False))
    _train(engine, batches, parallel.data.rank, range(STEPS - 1))
    engine.save_checkpoint(ckpt_dir)
    engine.destroy()
    engine = zeroplus.initialize(_engine_model(parallel.expert.rank), _config(3, predict=False))
    engine.load_checkpoint(ckpt_dir)
    losses, norms = _train(engine, batches, parallel.data.rank, range(STEPS - 1, STEPS))
    results["resumed"] = {"losses": losses, "norms": norms, "params": _params(engine, local)}
    with pytest.raises(ValueError, match=r"save_16bit_model\(\) writes one whole model"):
        engine.save_16bit_model(ckpt_dir + "-16bit")  # each rank holds half the experts: refused, not half-written
    engine.destroy()
    # saved by 2 ranks, loaded by 4
    engine = zeroplus.initialize(_engine_model(parallel.expert.rank), _config(1, predict=False))
    engine.load_checkpoint(two_rank_ckpt)
    results["elastic"] = {"params": _params(engine, local)}
    engine.destroy()
    zeroplus.parallel.reset_parallel()  # the same checkpoint with every expert on every rank: refused
    zeroplus.init_parallel(_config(1, expert=1))
    engine = zeroplus.initialize(GPT(_gpt_config()), _config(1, expert=1, predict=False))
    with pytest.raises(ValueError) as refused:
        engine.load_checkpoint(ckpt_dir)
    return {"data_rank": parallel.data.rank, "cases": results, "refusal": str(refused.value)}


def _reference() -> tuple[list[list[float]], list[float], dict[str, torch.Tensor]]:
    model, batches = _reference_model(), _batches()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    norms, dropped = [], 0
    set_aux_grad_scale(1.0 / (WORLD * GAS))  # the balancing loss is weighted as the task loss is
    try:
        for s in range(STEPS):
            for k in range(GAS):
                for r in range(WORLD):
                    x, y = batches[(s * GAS + k) * WORLD + r]
                    loss = model(x, y)
                    (loss / (WORLD * GAS)).backward()
                    losses[r].append(loss.item())
            norms.append(clip_global_norm(list(model.parameters()), CLIP))
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        set_aux_grad_scale(1.0)
    with torch.no_grad():
        x = model.wte(batches[0][0]).reshape(-1, model.config.n_embd)
        dropped = int((model.blocks[0].mlp.moe.gate(x)[1] < 0).sum())
    assert dropped > 0, "no choice was dropped: the capacity path is untested"
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_data_x_expert_matches_all_experts_in_one_process_at_zero_0_to_3(tmp_path):
    saved_by_two = run_distributed(_save_at_two_ranks, 2, str(tmp_path / "two"))
    ranks = run_distributed(_expert_job, WORLD, str(tmp_path / "ckpt"), str(tmp_path / "two"), timeout=600)
    ref_losses, ref_norms, ref_params = _reference()
    assert ref_norms[0] > CLIP
    with pytest.raises(ValueError, match="does not record how its model was cut"):  # (zeroplus's own MoE layers)
        zeroplus.load_fp32_state_dict(str(tmp_path / "ckpt"))
    for rank, got in enumerate(ranks):  # elastic: what 2 ranks saved (expert-data 1) is what 4 ranks load (2)
        elastic = got["cases"].pop("elastic")["params"]
        saved = saved_by_two[rank % 2]  # the rank with the same expert rank
        for name, value in elastic.items():
            assert torch.equal(value, saved[name]), f"rank {rank}: {name} loaded at 4 ranks differs from the save"
    for rank, got in enumerate(ranks):
        assert "expert 2" in got["refusal"] and "expert 1" in got["refusal"], got["refusal"]
        d = got["data_rank"]
        for case, result in got["cases"].items():
            where = f"rank {rank} (data {d}), ZeRO {case}"
            steps = range(STEPS - 1, STEPS) if case == "resumed" else range(STEPS)
            want_losses = [ref_losses[d][s * GAS + k] for s in steps for k in range(GAS)]
            assert result["losses"] == pytest.approx(want_losses, rel=2e-5), f"{where}: losses"
            assert result["norms"] == pytest.approx([ref_norms[s] for s in steps], rel=2e-5), f"{where}: norms"
            assert set(result["params"]) <= set(ref_params), f"{where}: parameters held"
            for name, value in result["params"].items():  # Adam: rounding noise decides near-zero updates
                torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=LR / 10,
                                           msg=lambda m, n=name: f"{where}, {n}: {m}")
            if "ledger" in result and rank < 2:
                _check_estimate(result["ledger"], result["engine_predicted"], case, rank, where)
            elif "ledger" in result:  # ranks 2, 3 hold the shapes of ranks 0, 1 (their expert ranks): the engine's own
                assert_model_states_predicted(result["ledger"], where, engine=result["engine_predicted"])
    for case in ranks[0]["cases"]:
        held = set().union(*(set(r["cases"][case]["params"]) for r in ranks))
        assert held == set(ref_params), f"ZeRO {case}: the ranks together hold every expert"


def _check_estimate(measured: dict[str, int], engine_predicted: dict[str, int], stage: int, rank: int,
                    where: str) -> None:
    """``zeroplus.estimate`` of this rank (its experts, dense parameters over 4 ranks and experts over 2),
    and the engine's own prediction at its first forward, give the model-state peaks the engine's ledger
    measured, byte for byte."""
    budget = zeroplus.estimate(lambda: GPT(_gpt_config()), _config(stage), world_size=WORLD, rank=rank,
                               seq_len=SEQ)
    assert_model_states_predicted(measured, where, estimate=budget.category_peaks, engine=engine_predicted)


def test_estimate_command_builds_each_ranks_slice(tmp_path, capsys):
    """``zeroplus estimate`` with the config's expert size builds the rank's GPT with its experts (as
    ``zeroplus.estimate`` with the same rank's builder) and names the split."""
    path = tmp_path / "ep.json"
    path.write_text(json.dumps(_config(2)))
    cmd = ["estimate", "--model", "tiny", "--experts", str(EXPERTS), "--config", str(path), "--world-size", str(WORLD),
           "--rank", "1", "--seq-len", str(SEQ)]
    status, printed, err = run_cli(cmd + ["--json"], capsys)
    assert status == 0, err
    config = _config(2)
    expected = zeroplus.estimate(lambda: GPT(gpt_config("tiny", moe_experts=EXPERTS, moe_k=2)), config,
                                 world_size=WORLD, rank=1, seq_len=SEQ)
    assert json.loads(printed) == json.loads(json.dumps(expected.to_dict()))
    assert expected.topology == "4 ranks = data 4 x tensor 1 x pipeline 1 x expert 2 (expert-data 2)"
    dense = zeroplus.estimate(lambda: GPT(gpt_config("tiny")), _config(2, expert=1), world_size=WORLD, rank=1,
                              seq_len=SEQ)  # (a model without experts at expert size 2 is refused)
    assert expected.model_states["optim_state"] > dense.model_states["optim_state"]  # + 2 of 4 experts, sharded by 2
    assert "rank 1 of 4 (4 ranks = data 4 x tensor 1 x pipeline 1 x expert 2" in expected.table()
