"""Cases DeepSpeed's users reported as silent or hanging under ZeRO, each against one process (2 gloo ranks, ZeRO-3).

- PEFT's ``modules_to_save`` (LoRA on a tiny Qwen2 with a trained copy of ``lm_head``): the copy is a trainable
  module beside the frozen original, both partitioned; losses and every trained parameter equal the plain PEFT
  model's.
- A hybrid linear/full-attention MoE (a tiny Qwen3-Next: gated delta-rule layers between full-attention layers,
  routed and shared experts): the same.

SGD with momentum (not Adam, which turns rounding-level gradient differences in near-zero elements into full
steps): losses within 1e-5 relative, parameters within 1e-5 of each tensor's largest value. (A module attached
after ``initialize`` and a unit mixing fp32 and bf16 parameters are in ``tests/engine/test_misuse.py``.)
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import LossOf, build
from tests.reference import engine_train, reference_train

STEPS, LR, WORLD = 3, 1e-2, 2


def _peft_modules_to_save() -> torch.nn.Module:
    import peft
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    return LossOf(peft.get_peft_model(build("qwen2"), config))


def _qwen3_next() -> torch.nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    config = tf.Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2)
    return LossOf(tf.Qwen3NextForCausalLM(config))


MODELS = {"peft_modules_to_save": _peft_modules_to_save, "qwen3_next": _qwen3_next}


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(x, x) for x in (torch.randint(0, 256, (2, 16), generator=g) for _ in range(STEPS * WORLD))]


def _train(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, world = rank_and_world()
    engine = zeroplus.initialize(MODELS[name](), {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zeroplus": {"log_level": "warning", "memory_estimate": False}})
    losses = engine_train(engine, _batches(), STEPS, rank, world, 1)
    return losses, engine.consolidated_fp32_state()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_reported_case_trains_as_one_process(name):
    model = MODELS[name]()
    losses, state = reference_train(model, _batches(), STEPS, WORLD, 1, LR, 0.0, weight_decay=0.0, optimizer="SGD")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    got_losses, got = run_distributed(_train, WORLD, name)[0]
    assert got_losses == pytest.approx(losses, rel=1e-5), (got_losses, losses)
    assert trained <= set(got), sorted(trained - set(got))[:5]
    for n in trained:
        floor = 1e-5 * state[n].abs().max().item()
        torch.testing.assert_close(got[n], state[n], rtol=1e-5, atol=floor, msg=lambda m, n=n: f"{name} {n}: {m}")
