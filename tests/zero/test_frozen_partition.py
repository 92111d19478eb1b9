"""Frozen parameters at ZeRO-3 (issue 36): a LoRA model's base is partitioned in the compute dtype, with
no gradient, master or optimizer state, and trains as the plain PEFT model does.

PEFT LoRA (rank 4 on every projection) over a tiny Hugging Face Llama, 2 gloo ranks, fp32, AdamW,
clipping, 3 steps, with and without Hugging Face's activation checkpointing (the replay reads the
frozen weights inside backward), against the single-process reference (``tests/reference.py``):
losses and adapters equal within 1e-5 relative (gradients averaged in another order). The ledger:
``param`` holds this rank's shard of the base (half of it, plus padding), ``master`` (the fp32 shard
itself) and ``optim_state`` the adapters' shard only.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import LossOf, build
from tests.reference import engine_train, reference_train
from zeroplus.ledger import Category

peft = pytest.importorskip("peft")
LR, CLIP, STEPS, WORLD = 1e-3, 1.0, 3, 2


LM = LossOf


def _lora(checkpointing: bool) -> LM:
    torch.manual_seed(0)
    base = build("llama")
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return LM(peft.get_peft_model(base, config))


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(x, x) for x in (torch.randint(0, 256, (2, 16), generator=g) for _ in range(STEPS * WORLD))]


def _train_at_stage3(model: torch.nn.Module, rank: int, world: int) -> tuple:
    """ZeRO-3, AdamW, clipping, ``STEPS`` steps: the engine, and the losses and the adapters' masters."""
    engine = zeroplus.initialize(model, {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zeroplus": {"log_level": "warning", "memory_estimate": False}})
    losses = engine_train(engine, _batches(), STEPS, rank, world, 1)
    state = engine.consolidated_fp32_state()
    return engine, {"losses": losses, "adapters": {n: v for n, v in state.items() if "lora_" in n}}


def _train(checkpointing: bool) -> dict:
    rank, world = rank_and_world()
    model = _lora(checkpointing)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine, out = _train_at_stage3(model, rank, world)
    return {**out, "bytes": {c.value: engine.ledger.live_bytes(c) for c in Category}, "base": base,
            "adapters_numel": adapters, "frozen_groups": len(engine.partition.frozen)}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_base_is_partitioned_and_trains_as_the_plain_peft_model(checkpointing):
    results = run_distributed(_train, WORLD, checkpointing)
    reference = _lora(checkpointing)
    losses, final = reference_train(reference, _batches(), STEPS, WORLD, 1, LR, CLIP)
    for r in results:
        b = r["bytes"]
        assert r["frozen_groups"] >= 3, "each decoder layer's base and the root's are frozen groups"
        assert 4 * r["base"] / WORLD <= b["param"] <= 4 * r["base"] / WORLD + 4 * 64 * r["frozen_groups"], b
        assert 4 * r["adapters_numel"] / WORLD <= b["master"] <= 4 * (r["adapters_numel"] / WORLD + 64 * 16), b
        assert 8 * r["adapters_numel"] / WORLD <= b["optim_state"] <= 8 * (r["adapters_numel"] / WORLD + 64 * 16), b
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in results[0]["adapters"].items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _qlora(path: str, storage: torch.dtype) -> LM:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    quantized = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_quant_storage=storage))
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    return LM(peft.get_peft_model(quantized, config))


def _packed(model: torch.nn.Module) -> dict:
    """The packed 4-bit weights as raw bytes (in float32 storage some bit patterns are NaNs)."""
    return {n: p.detach().view(torch.uint8).clone() for n, p in model.named_parameters() if hasattr(p, "quant_state")}


def _train_qlora(path: str, storage: torch.dtype) -> dict:
    rank, world = rank_and_world()
    model = _qlora(path, storage)
    engine, out = _train_at_stage3(model, rank, world)
    return {**out, "packed": _packed(engine.module)}


@pytest.mark.parametrize("storage", [torch.uint8, torch.float32])
def test_qlora_trains_over_the_4bit_base_as_the_plain_peft_model(tmp_path, storage):
    """QLoRA (bitsandbytes' NF4 base on its CPU backend, packed in uint8 or, as FSDP recipes ask with
    ``bnb_4bit_quant_storage``, in float32; LoRA adapters in fp32) at ZeRO-3: the packed
    4-bit weights stay whole on every rank, bit for bit the plain model's (never cast, dequantized or
    summed by a collective: a ``Parameter`` subclass is not flattened), the rest of the base is
    partitioned, and losses and adapters equal the plain single-process model's within 1e-5 relative."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install bitsandbytes)")
    torch.manual_seed(0)
    build("llama").save_pretrained(tmp_path / "base")
    results = run_distributed(_train_qlora, WORLD, str(tmp_path / "base"), storage)
    reference = _qlora(str(tmp_path / "base"), storage)
    losses, final = reference_train(reference, _batches(), STEPS, WORLD, 1, LR, CLIP)
    packed = _packed(reference)  # (bitsandbytes' CPU backend may repack them in its first forward)
    assert len(packed) >= 6
    for r in results:
        assert sorted(r["packed"]) == sorted(packed) and all(torch.equal(r["packed"][n], packed[n]) for n in packed)
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in results[0]["adapters"].items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
