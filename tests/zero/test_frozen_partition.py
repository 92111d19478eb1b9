"""Frozen parameters at ZeRO-3: a LoRA model's base is partitioned in the compute dtype, with
no gradient, master or optimizer state, and trains as the plain PEFT model does.

PEFT LoRA (rank 4 on every projection) over a tiny Hugging Face Llama, 2 gloo ranks, fp32, AdamW,
clipping, 3 steps, with and without Hugging Face's activation checkpointing (the replay reads the
frozen weights inside backward), against the single-process reference (``tests/reference.py``):
losses and adapters equal within 1e-5 relative (gradients averaged in another order). The ledger:
``param`` holds this rank's shard of the base (half of it, plus padding), ``master`` (the fp32 shard
itself) and ``optim_state`` the adapters' shard only. PEFT's ``get_nb_trainable_parameters`` and the Trainer's
count (through ``ds_numel``) read the whole model's numbers, and every ``ds_shape`` the whole shape.
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
    trainer_rule = [p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()]  # the Trainer's
    return {**out, "bytes": {c.value: engine.ledger.live_bytes(c) for c in Category}, "base": base,
            "adapters_numel": adapters, "frozen_groups": len(engine.partition.frozen),
            "peft_counts": model.model.get_nb_trainable_parameters(), "trainer_count": sum(trainer_rule),
            "ds_shapes": {n: tuple(p.ds_shape) for n, p in model.named_parameters()}}


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
    peft_counts = reference.model.get_nb_trainable_parameters()
    for rank, r in enumerate(results):  # counts and shapes of released parameters read as DeepSpeed's (ds_numel)
        assert r["peft_counts"] == peft_counts, f"rank {rank}: PEFT counts {r['peft_counts']}, plain {peft_counts}"
        assert r["trainer_count"] == peft_counts[1], f"rank {rank}: the Trainer's count {r['trainer_count']}"
        assert r["ds_shapes"] == {n: tuple(p.shape) for n, p in reference.named_parameters()}, f"rank {rank}"
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
    model = LM(peft.get_peft_model(quantized, config))
    return model.train()  # (from_pretrained returns eval mode, where bitsandbytes' CPU backend repacks: quantized.py)


def _packed_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if hasattr(p, "quant_state")]


def _packed(model: torch.nn.Module, names: list[str]) -> dict:
    """The packed 4-bit weights as raw bytes (in float32 storage some bit patterns are NaNs), read through
    ``state_dict()`` (a collective at stage 3: it gathers them)."""
    state = model.state_dict()
    return {n: state[n].detach().view(torch.uint8).clone() for n in names}


def _eval_losses(model: torch.nn.Module, batches: list) -> list[float]:
    """Losses of an inference-mode pass (``eval()``, no gradients: where bitsandbytes' CPU backend would
    repack a 4-bit weight in place), then the model back in training mode."""
    model.eval()
    with torch.no_grad():
        out = [model(x, y).item() for x, y in batches]
    model.train()
    return out


def _train_qlora(path: str, storage: torch.dtype) -> dict:
    rank, world = rank_and_world()
    model = _qlora(path, storage)
    names = _packed_names(model)
    if storage == torch.float32:  # a weight that does not name its layer: zeroplus finds the layer holding it
        for n, p in model.named_parameters():
            if n in names:
                p.module = None
    packed_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if n in names}
    engine, out = _train_at_stage3(model, rank, world)
    groups = [(g.name, g.compute_dtype, g.shard.numel() * g.shard.element_size(), g.numel * g.shard.element_size())
              for g in engine.partition.frozen]
    evals = _eval_losses(engine, _batches()[:2])
    engine.module.model.save_pretrained(f"{path}-adapter{rank}")  # PEFT's adapter save (state_dict: a collective)
    return {**out, "packed": _packed(engine.module, names), "groups": groups, "packed_bytes": packed_bytes,
            "evals": evals, "param_bytes": engine.ledger.live_bytes(Category.PARAM)}


@pytest.mark.parametrize("storage", [torch.uint8, torch.float32])
def test_qlora_partitions_the_4bit_base_and_trains_as_the_plain_peft_model(tmp_path, storage):
    """QLoRA (bitsandbytes' NF4 base on its CPU backend, packed in uint8 or, as FSDP recipes ask with
    ``bnb_4bit_quant_storage``, in float32; LoRA adapters in fp32) at ZeRO-3: the packed 4-bit weights
    are partitioned as raw storage (each rank holds half of their bytes; never cast, dequantized or
    summed by a collective), gathered bit for bit the plain model's, and losses and adapters equal the
    plain single-process model's within 1e-5 relative; an inference-mode pass afterwards (where the
    CPU backend would repack a weight in place) gives the plain model's losses and leaves the packing."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install bitsandbytes)")
    torch.manual_seed(0)
    build("llama").save_pretrained(tmp_path / "base")
    results = run_distributed(_train_qlora, WORLD, str(tmp_path / "base"), storage)
    reference = _qlora(str(tmp_path / "base"), storage)
    losses, final = reference_train(reference, _batches(), STEPS, WORLD, 1, LR, CLIP)
    names = _packed_names(reference)
    packed = _packed(reference, names)
    assert len(packed) >= 6
    reference.train()
    with torch.no_grad():
        evals = [reference(x, y).item() for x, y in _batches()[:2]]
    storage_name = str(storage).split(".")[-1]
    for r in results:
        assert sorted(r["packed"]) == sorted(packed) and all(torch.equal(r["packed"][n], packed[n]) for n in packed)
        quantized = [(name, total) for name, dtype, _, total in r["groups"] if dtype == storage]
        assert len(quantized) >= 2, r["groups"]  # each decoder layer's packed weights
        assert all(name.endswith(f"#frozen-{storage_name}") or storage == torch.float32 for name, _ in quantized)
        assert sum(total for _, total in quantized) >= sum(r["packed_bytes"].values())
        shards = sum(shard for _, dtype, shard, _ in r["groups"] if dtype == storage)
        totals = sum(total for _, dtype, _, total in r["groups"] if dtype == storage)
        assert totals <= shards * WORLD < totals + 64 * len(r["groups"])  # half each, plus padding
        assert r["param_bytes"] < sum(r["packed_bytes"].values()) / WORLD + 4 * sum(
            p.numel() for p in reference.parameters() if not p.requires_grad and not hasattr(p, "quant_state"))
        assert r["evals"] == pytest.approx(evals, rel=1e-5)
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in results[0]["adapters"].items():
        torch.testing.assert_close(value, final[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "base-adapter0" / "adapter_model.safetensors"))
    assert len(saved) == len(results[0]["adapters"]) and all(".lora_" in n for n in saved)
    for name, value in saved.items():  # (PEFT drops the adapter's name from the keys)
        trained = final["model." + name.replace(".weight", ".default.weight")]  # (LossOf wraps the PEFT model)
        torch.testing.assert_close(value, trained, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _initialize_after_an_inference_pass(path: str) -> str:
    rank, world = rank_and_world()
    model = _qlora(path, torch.uint8)
    _eval_losses(model, _batches()[:1])  # bitsandbytes' CPU backend repacks the 4-bit weights here
    try:
        _train_at_stage3(model, rank, world)
    except ValueError as err:
        return str(err)
    return "no error"


def test_qlora_weight_in_the_cpu_inference_layout_is_refused_naming_it(tmp_path):
    """A 4-bit weight bitsandbytes repacked for CPU inference (an eval-mode forward before initialize) cannot be
    partitioned in its storage layout: every rank refuses, naming the weight and what to do."""
    bnb = pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install bitsandbytes)")
    if not bnb.functional.has_avx512bf16():
        pytest.skip("bitsandbytes repacks 4-bit weights for inference only on CPUs with avx512_bf16")
    torch.manual_seed(0)
    build("llama").save_pretrained(tmp_path / "base")
    for rank, message in enumerate(run_distributed(_initialize_after_an_inference_pass, WORLD, str(tmp_path / "base"))):
        assert f"rank {rank}" in message and "q_proj.base_layer.weight" in message, message
        assert "CPU inference layout" in message and "before any eval-mode forward" in message, message
