"""Hugging Face mixture-of-experts models at ZeRO-3, each rank's tokens routed to other experts.

Under DeepSpeed's ZeRO-3 a rank whose tokens skip an expert never gathers that expert's parameters,
and the other rank waits for it: users mark each MoE block class with ``set_z3_leaf_modules`` by
hand. zeroplus gathers a whole decoder layer (one unit) whatever the routing, so nothing needs
marking; ``set_z3_leaf_modules`` is accepted and returns the blocks. Transformers 5.23's Mixtral
packs each layer's experts into 3-D parameters (``experts.gate_up_proj``: experts x 2 ffn x hidden).

Rank 0 trains on token ids below half the vocabulary and rank 1 on ids above it, so the routers send
their tokens to different experts. Built three ways (normally, under ``zeroplus.Init``, and on the
meta device then ``engine.load_pretrained`` from a safetensors file in the packed layout; the files
Transformers' ``save_pretrained`` writes, one tensor per expert, are refused naming that), 2 gloo
ranks, fp32, AdamW with clipping, 3 steps: the losses and final weights equal the plain model's
trained in one process on the same batches within 1e-5 relative (gradients averaged in another
order; weights also within 2e-5 absolute, as Adam scales up near-zero gradients whose summation
order then shows).
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import LossOf, build
from tests.reference import reference_train

LR, CLIP, STEPS, WORLD, VOCAB = 1e-3, 1.0, 3, 2, 256


LM = LossOf


def _batches() -> list:
    """Batch ``s * WORLD + r`` is rank r's at step s: rank 0's ids in the lower half, rank 1's in the upper."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        for r in range(WORLD):
            x = torch.randint(r * VOCAB // 2, (r + 1) * VOCAB // 2, (2, 16), generator=g)
            out.append((x, x))
    return out


CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _train(how: str, saved: str) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    if how == "init":
        with zeroplus.Init(config_dict_or_path=CONFIG):
            model = build("mixtral")
    elif how == "meta":  # (initialize rebuilds a Hugging Face model from its config at shard memory)
        with torch.device("meta"):
            model = build("mixtral")
    else:
        model = build("mixtral")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from zeroplus.deepspeed_api.utils import set_z3_leaf_modules
    leaves = set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
    engine = zeroplus.initialize(model, CONFIG)
    if how == "meta":
        try:  # Transformers' own files: one tensor per expert
            engine.load_pretrained(saved + "-per-expert")
            refused = ""
        except ValueError as err:
            refused = str(err)
        assert "one tensor per expert" in refused and "not built yet" in refused, refused
        engine.load_pretrained(saved)
    packed = sum(1 for g in engine.partition.groups for s in g.shapes if len(s) == 3)
    losses = []
    batches = _batches()
    for step in range(STEPS):
        x, y = batches[step * world + rank]
        loss = engine(input_ids=x, labels=y).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.consolidated_fp32_state(), "packed": packed, "leaves": len(leaves)}


@pytest.mark.parametrize("how", ["plain", "init", "meta"])
def test_mixtral_with_ranks_routed_apart_trains_as_one_process(tmp_path, how):
    torch.manual_seed(0)
    reference = LM(build("mixtral"))
    from safetensors.torch import save_file
    (tmp_path / "mixtral").mkdir()  # the packed layout as the model holds it (save_pretrained writes the old one)
    save_file({n: t.contiguous() for n, t in reference.model.state_dict().items()},
              str(tmp_path / "mixtral" / "model.safetensors"))
    reference.model.save_pretrained(tmp_path / "mixtral-per-expert")
    losses, final = reference_train(reference, _batches(), STEPS, WORLD, 1, LR, CLIP)
    results = run_distributed(_train, WORLD, how, str(tmp_path / "mixtral"))
    assert results[0]["packed"] == 4 and results[0]["leaves"] == 2, "2 layers' packed experts, 2 MoE blocks"
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5)
    assert results[0]["losses"] != results[1]["losses"], "the ranks trained on different tokens"
    for name, value in results[0]["state"].items():  # (Adam scales near-zero gradients up: their summation
        # order shows as up to 4e-6 in a weight at lr 1e-3)
        torch.testing.assert_close(value, final[f"model.{name}"], rtol=1e-5, atol=2e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")
