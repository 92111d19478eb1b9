"""ZeRO++'s quantized frozen weights (``zero_optimization.zero_quantized_nontrainable_weights``): stage 3 keeps each
frozen shard as int8 codes and an fp32 scale per 256 elements (``zero/quantized_comm.py``'s ``QuantizedShard``), and
gathers the codes as they are.

Two gloo ranks, the tiny GPT at stage 3 in fp32 with every block's attention and MLP input projections frozen (a
fine-tuning's frozen base), three steps against the same model unquantized: the ledger's ``param`` (the frozen shards:
the trained ones are masters) holds the codes and scales, to the byte, instead of 4 bytes an element, and the estimate
predicts its peak; every frozen weight read whole (``state_dict()``) is within half a step of its group's largest
magnitude of the model's value, and not all exact; the losses stay within 1%; a checkpoint loads back into an engine
with the key, built with its frozen weights zeroed, with every frozen weight within 1e-6 of what it saved. Stage 2
with the key is refused on every rank.
"""
from __future__ import annotations

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import train_losses
from tests.reference import initialize_says
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config
from zeroplus.zero import quantized_comm
from zeroplus.zero.quantized_comm import BLOCK


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    for block in model.blocks:
        block.attn.qkv.requires_grad_(False)
        block.mlp.fc.requires_grad_(False)
    return model


def _frozen(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _config(quantized: bool, stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "zero_quantized_nontrainable_weights": quantized,
                                  "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": True}}


def _run(quantized: bool, root: str) -> dict:
    rank, _ = rank_and_world()
    model = _model()
    engine = zeroplus.initialize(model, _config(quantized))
    shards = [g.shard_numel for g in engine.partition.frozen]
    losses = train_losses(engine, hugging_face=False, vocab=256, seq=32, seed=rank, steps=3)
    assert engine.budget is not None
    frozen = {k: v for k, v in engine.module.state_dict().items() if k in _frozen(_model())}
    result = {"losses": losses, "shards": shards, "frozen": frozen,
              "param": (engine.ledger.live_bytes(Category.PARAM), engine.ledger.peak_bytes(Category.PARAM),
                        engine.budget.category_peaks["param"])}
    if quantized:
        engine.save_checkpoint(root, tag="codes")
        blank = _model()
        for p in blank.parameters():
            if not p.requires_grad:
                torch.nn.init.zeros_(p)  # (what the load must write back)
        again = zeroplus.initialize(blank, _config(True))
        again.load_checkpoint(root, tag="codes")
        result["loaded"] = {k: v for k, v in again.module.state_dict().items() if k in frozen}
        again.destroy()
    engine.destroy()
    return result


def _both(root: str) -> list[dict]:
    return [_run(False, root), _run(True, root)]


def test_frozen_shards_kept_as_codes_take_a_byte_an_element_and_stay_within_half_a_step(tmp_path):
    exact = _frozen(_model())
    for rank, (plain, codes) in enumerate(run_distributed(_both, 2, str(tmp_path))):
        coded = sum(quantized_comm.blocks(shard) * (BLOCK + 4) for shard in codes["shards"])
        assert plain["param"][0] == sum(4 * shard for shard in plain["shards"]), (rank, plain["param"])
        assert codes["param"][0] == coded, (rank, codes["param"], coded)
        assert codes["param"][1] == codes["param"][2], (rank, codes["param"])  # the estimate's peak, exactly
        assert plain["param"][1] == plain["param"][2], (rank, plain["param"])
        errors = []
        for name, value in exact.items():
            assert torch.equal(plain["frozen"][name], value), name
            error = (codes["frozen"][name] - value).abs()
            # (a block may span parameters of a group: half a step is at most the group's largest over 254)
            assert error.max() <= max(v.abs().max() for v in exact.values()) / 254 * (1 + 1e-6), name
            errors.append(error.max())
            torch.testing.assert_close(codes["loaded"][name], codes["frozen"][name], rtol=1e-6, atol=1e-7)
        assert max(errors) > 0, rank
        for a, b in zip(codes["losses"], plain["losses"]):
            assert abs(a - b) <= 0.01 * abs(b), (rank, codes["losses"], plain["losses"])


def _refused() -> str:
    return initialize_says(_model, [_config(True, stage=2)])[0]


def test_frozen_codes_below_stage_3_are_refused_on_every_rank():
    for rank, said in enumerate(run_distributed(_refused, 2)):
        assert "zero_quantized_nontrainable_weights" in said and "stage 2 keeps frozen" in said, said
        assert f"rank {rank}" in said, said
