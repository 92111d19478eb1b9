"""The planner chooses the tensor size: ``"tensor_parallel": {"autotp_size": "auto"}`` beside a memory budget.

- 4 ranks, a Llama whose MLP is wide (so a tensor split halves its gathered units and its activations): rank 0's
  budget halfway between the smallest predicted peak at tensor 1 (ZeRO stage 1 or 3 over 4 data ranks) and at tensor
  2 (over 2). ``initialize`` plans before any group splits the model and takes tensor 2 (nothing at tensor 1 fits),
  every rank the same; the model is split by its plan (``q_proj`` holds half its rows); the first forward's
  prediction is within the budget; and the run trains bit for bit the model the chosen settings written out train
  (tensor 2 and the chosen stage, no budget).
- With room for every choice, tensor 1 (tensor parallelism is a way to fit, tried smallest size first).
- Refused, naming the key: 'auto' on a model without a plan (zeroplus's GPT), 'auto' without a budget, 'auto' beside
  a tensor size in ``zeroplus.parallel.tensor``.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from zeroplus.budget.first_use import code_resident
from zeroplus.budget.planner import Settings, apply_settings, plan
from zeroplus.config import ConfigError, parse_config
from zeroplus.host_gemm_pool import held_bytes
from zeroplus.models import GPT, gpt_config

SEQ, MICRO, STEPS = 32, 2, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


def _config(budget: int | str | None, tensor: int | str = "auto", stage: int | str = "auto") -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "tensor_parallel": {"autotp_size": tensor},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "seq_len": SEQ, "memory_budget": budget,
                         "resize_recompute": {"enabled": False}}}


def _train(engine: zeroplus.Engine) -> list[float]:
    g = torch.Generator().manual_seed(1 + rank_and_world()[0] // 2)  # (a batch per data rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randint(0, 256, (MICRO, SEQ), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _smallest(tensor: int) -> int:
    """The smallest predicted peak at ``tensor`` over 4 ranks (stage 1 or 3), for this process (as initialize)."""
    cfg = parse_config(_config(None, stage=0))[0]
    return min(zeroplus.estimate(_model, apply_settings(cfg, Settings(stage, None, False, False, tensor=tensor)),
                                 world_size=4, seq_len=SEQ, code=code_resident(), pooled=held_bytes()).peak_bytes
               for stage in (1, 3))


def _planned_job() -> dict:
    rank, _ = rank_and_world()
    box = [(_smallest(1), _smallest(2)) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    one, two = box[0]
    budget = (one + two) // 2
    engine = zeroplus.initialize(_model(), _config(budget))
    chosen = {"tensor": engine.parallel.topology.tensor, "stage": engine.zero_optimization_stage(),
              "q_rows": engine.module.model.layers[0].self_attn.q_proj.weight.shape[0]}
    losses = _train(engine)
    predicted = engine.budget.peak_bytes if engine.budget is not None else None
    engine.destroy()
    written = zeroplus.initialize(_model(), _config(None, chosen["tensor"], chosen["stage"]))
    same = _train(written)
    written.destroy()
    return {"one": one, "two": two, "budget": budget, **chosen, "losses": losses, "written": same,
            "predicted": predicted}


def test_a_budget_only_a_tensor_split_fits_plans_tensor_2_and_trains_as_the_written_settings():
    results = run_distributed(_planned_job, 4)
    first = results[0]
    assert first["two"] < first["budget"] < first["one"], first
    for rank, r in enumerate(results):
        assert (r["tensor"], r["stage"]) == (first["tensor"], first["stage"]) and r["tensor"] == 2, (rank, r)
        assert r["q_rows"] == 64, (rank, r["q_rows"])  # 4 heads of 32 split over 2 ranks
        assert r["predicted"] is not None and r["predicted"] <= r["budget"], (rank, r)
        assert r["losses"] == r["written"], (rank, r["losses"], r["written"])


def test_with_room_for_everything_the_plan_keeps_tensor_1():
    chosen = plan(_model, _config("64GB"), world_size=4)
    assert chosen.settings.tensor == 1 and chosen.settings.stage == 0, chosen.reason
    assert "tensor parallel" not in chosen.reason


def test_auto_tensor_is_refused_without_a_plan_a_budget_or_beside_a_size():
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size' is 'auto'.*GPT has no tensor-parallel plan"):
        zeroplus.initialize(GPT(gpt_config("tiny")), _config("64GB"))
    with pytest.raises(ConfigError, match=r"tensor_parallel.autotp_size.*'auto'.*zeroplus.memory_budget"):
        zeroplus.initialize(_model(), _config(None))
    both = _config("64GB")
    both["zeroplus"]["parallel"] = {"tensor": 2}
    with pytest.raises(ConfigError, match=r"'tensor_parallel.autotp_size' is 'auto' and 'zeroplus.parallel.tensor' "
                                          r"is 2"):
        zeroplus.initialize(_model(), both)
