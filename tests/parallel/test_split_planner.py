"""The planner chooses how many ranks split a Hugging Face model: ``"tensor_parallel": {"autotp_size": "auto"}`` or
``"expert_parallel": {"enabled": true, "autoep_size": "auto"}`` beside a memory budget.

- 4 ranks; a Llama whose MLP is wide (a tensor split halves its gathered units and its activations) and a Mixtral
  whose experts are (an expert split halves them): rank 0's budget halfway between the smallest predicted peak
  (ZeRO stage 1 or 3) unsplit and split over 2. ``initialize`` plans before any group splits the model and takes a
  split of 2 (nothing unsplit fits), every rank the same; the model is split by its plan (``q_proj`` holds half its
  rows; each experts module half the experts); the first forward's prediction is within the budget; and the run
  trains bit for bit the model the chosen settings written out train (the size and the stage, no budget). The
  budget beside the size given (2) and the stage 'auto' plans the same stage.
- With room for every choice, no split (it is a way to fit, tried with the fewest ranks first).
- Refused, naming the key: 'auto' on a model without the plan it needs (zeroplus's GPT; a dense Llama for experts),
  'auto' without a budget, 'auto' beside a size in ``zeroplus.parallel``, 'auto' beside a pipeline size.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import zeroplus
from tests.dist_helper import rank0_value, rank_and_world, run_distributed
from zeroplus.budget import planner
from zeroplus.budget.first_use import code_resident
from zeroplus.budget.planner import Settings, apply_settings, plan
from zeroplus.config import ConfigError, parse_config
from zeroplus.models import GPT, gpt_config

SEQ, MICRO, STEPS = 32, 2, 2


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def _mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))


MODELS = {"tensor": _llama, "expert": _mixtral}


def _config(kind: str, budget: int | str | None, size: int | str = "auto", stage: int | str = "auto") -> dict:
    split = {"tensor_parallel": {"autotp_size": size}} if kind == "tensor" else {
        "expert_parallel": {"enabled": True, "autoep_size": size}}
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **split,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "seq_len": SEQ, "memory_budget": budget,
                         "resize_recompute": {"enabled": False}}}


def _train(engine: zeroplus.Engine, data_rank: int) -> list[float]:
    g = torch.Generator().manual_seed(1 + data_rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (MICRO, SEQ), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _smallest(kind: str, size: int) -> int:
    """The smallest predicted peak split over ``size`` ranks on 4 (stage 1 or 3), for this process (as initialize)."""
    cfg = parse_config(_config(kind, None, stage=0))[0]
    return min(zeroplus.estimate(MODELS[kind], apply_settings(cfg, Settings(stage, None, False, False, **{kind: size})),
                                 world_size=4, seq_len=SEQ, code=code_resident()).peak_bytes
               for stage in (1, 3))


def _split_of(engine: zeroplus.Engine, kind: str) -> int:
    """What this rank holds of the layer the split cuts: q_proj's rows, or the first experts module's experts."""
    layer = engine.module.model.layers[0]
    return layer.self_attn.q_proj.weight.shape[0] if kind == "tensor" else layer.mlp.experts.num_experts


def _planned_job(kind: str) -> dict:
    rank, _ = rank_and_world()
    whole, halves = rank0_value(lambda: (_smallest(kind, 1), _smallest(kind, 2)))
    budget = (whole + halves) // 2
    engine = zeroplus.initialize(MODELS[kind](), _config(kind, budget))
    top = engine.parallel.topology
    chosen = {"size": getattr(top, kind), "stage": engine.zero_optimization_stage(), "held": _split_of(engine, kind)}
    data_rank = rank // top.tensor
    losses = _train(engine, data_rank)
    predicted = engine.budget.peak_bytes if engine.budget is not None else None
    engine.destroy()
    written = zeroplus.initialize(MODELS[kind](), _config(kind, None, chosen["size"], chosen["stage"]))
    same = _train(written, data_rank)
    written.destroy()
    given = zeroplus.initialize(MODELS[kind](), _config(kind, budget, 2))  # the size given, the stage planned
    given_stage = given.zero_optimization_stage()
    given.destroy()
    return {"whole": whole, "halves": halves, "budget": budget, **chosen, "losses": losses, "written": same,
            "predicted": predicted, "given_stage": given_stage}


@pytest.mark.parametrize("kind,held", [("tensor", 64), ("expert", 2)])  # 4 heads of 32 / 4 experts, over 2 ranks
def test_a_budget_only_a_split_fits_plans_a_split_of_2_and_trains_as_the_written_settings(kind, held):
    results = run_distributed(_planned_job, 4, kind)
    first = results[0]
    assert first["halves"] < first["budget"] < first["whole"], first
    for rank, r in enumerate(results):
        assert (r["size"], r["stage"]) == (2, first["stage"]), (rank, r)
        assert r["held"] == held, (rank, r["held"])
        assert r["predicted"] is not None and r["predicted"] <= r["budget"], (rank, r)
        assert r["losses"] == r["written"], (rank, r["losses"], r["written"])
        assert r["given_stage"] == r["stage"], (rank, r)  # a budget beside a given size: planned the same


@pytest.mark.parametrize("kind", ["tensor", "expert"])
def test_with_room_for_everything_the_plan_does_not_split(kind):
    chosen = plan(MODELS[kind], _config(kind, "64GB"), world_size=4)
    assert (chosen.settings.tensor, chosen.settings.expert, chosen.settings.stage) == (1, 1, 0), chosen.reason
    assert "parallel over" not in chosen.reason


def test_auto_sizes_are_refused_without_a_plan_a_budget_or_beside_a_size():
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size' is 'auto'.*GPT has no tensor-parallel plan"):
        zeroplus.initialize(GPT(gpt_config("tiny")), _config("tensor", "64GB"))
    with pytest.raises(ConfigError, match=r"expert_parallel.autoep_size' is 'auto'.*LlamaForCausalLM has no "
                                          r"(expert-parallel plan|experts module)"):
        zeroplus.initialize(_llama(), _config("expert", "64GB"))
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size.*'auto'.*zeroplus.memory_budget"):
        zeroplus.initialize(_llama(), _config("tensor", None))
    piped = _config("tensor", "64GB")
    piped["zeroplus"]["parallel"] = {"pipeline": 2}
    with pytest.raises(ConfigError, match=r"'tensor_parallel.autotp_size'\] are 'auto' beside pipeline size 2"):
        plan(_llama, piped, world_size=4)
    for kind in ("tensor", "expert"):
        both = _config(kind, "64GB")
        both["zeroplus"]["parallel"] = {kind: 2}
        with pytest.raises(ConfigError, match=r"is 'auto' and 'zeroplus.parallel.%s' is 2" % kind):
            zeroplus.initialize(MODELS[kind](), both)


def test_both_sizes_auto_on_a_mixture_of_experts_are_planned_as_pairs():
    """Tensor and expert sizes both 'auto' on Mixtral over 4 ranks: every (tensor, expert) pair the topology takes is a
    candidate, (2, 2) included (the experts split by expert, the rest by tensor: ``parallel/plans.py``), and there the
    tensor group's bytes leave out what splitting the experts by tensor would have added."""
    raw = _config("expert", "64GB")
    raw["tensor_parallel"] = {"autotp_size": "auto"}
    cfg = parse_config(raw)[0]
    with torch.device("meta"):
        model = _mixtral()
    layouts = planner._layouts(model, cfg, 4)
    assert set(layouts) == {(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)}, layouts
    raw["zeroplus"]["parallel"] = {"experts_span_tensor": True}  # (both ways refused there: parallel/plans.py)
    assert (2, 2) not in planner._layouts(model, parse_config(raw)[0], 4)
    exchanged = planner._exchanged(model, cfg, layouts, None, SEQ, None)
    assert 0 < exchanged[3] < exchanged[0], exchanged
    tensor_only, both = (planner.links(cfg, Settings(stage=1, ratio=None, shared=False, recompute=False, tensor=2,
                                                     expert=e), 0, 4, exchanged) for e in (1, 2))
    all_to_all = 4 * 1 / 2 * exchanged[2]  # fp32, (E - 1) / E of the rows
    assert tensor_only["intra_node"] - both["intra_node"] == 4 * 1 / 2 * 2 * exchanged[3] - all_to_all, (tensor_only,
                                                                                                         both)


def test_beside_a_tensor_size_mics_and_hpz_are_laid_over_a_nodes_data_ranks():
    """Llama at tensor 2 (given) on 8 ranks as 2 nodes of 4, stage 3, MiCS and hpZ left to the planner with room for
    every choice: a node holds 2 data ranks of each tensor rank (``parallel.groups.node_ranks``), so MiCS and hpZ are
    tried over 2, and the plan takes MiCS over 2, which sends fewer bytes across nodes than flat ZeRO-3 (the shards'
    all-reduce once a step, against every gather and reduction); the config it applies says 2. On nodes of 2 a node
    holds one data rank of each: nothing to lay over it."""
    raw = _config("tensor", "64GB", size=2, stage=3)
    raw["zero_optimization"] |= {"mics_shard_size": "auto", "zero_hpz_partition_size": "auto"}
    raw["zeroplus"]["node_size"] = 4
    cfg = parse_config(raw)[0]
    assert {(s.shard, s.secondary) for s in planner._candidates(cfg, 8, ((2, 1),))} == {(0, 0), (2, 0), (0, 2)}
    chosen = plan(_llama, raw, world_size=8)
    assert (chosen.settings.tensor, chosen.settings.shard, chosen.settings.secondary) == (2, 2, 0), chosen.reason
    assert chosen.apply(cfg).zero_optimization.mics_shard_size == 2
    params = sum(p.numel() for p in _llama().parameters())
    mics, flat = (planner.links(cfg, Settings(3, None, False, False, shard=shard, tensor=2), params, 8)
                  for shard in (2, 0))
    assert 0 < mics["inter_node"] < flat["inter_node"] / 4, (mics, flat)
    raw["zeroplus"]["node_size"] = 2
    assert {(s.shard, s.secondary) for s in planner._candidates(parse_config(raw)[0], 8, ((2, 1),))} == {(0, 0)}
