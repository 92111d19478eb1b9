"""``zeroplus.Init`` builds a model at the memory of its shards and ``initialize`` adopts it: the engine's
model equals, bit for bit, the same model built whole under the same seed (the built-in GPT, whose own
``__init__`` re-initialises every child's weights; Hugging Face Llama and GPT-2 with their
``post_init``; GPT-2's tied head stays tied), and trains the same. ``GatheredParameters`` gives whole
values to read, and to write from one rank."""
from __future__ import annotations

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import build
from tests.models import train_losses
from tests.new_storage import NewStorageBytes
from zeroplus.models import GPT, gpt_config
from zeroplus.zero.init_shards import shard_of

WINDOW = 64 * 2**10  # bytes kept gathered while a parent initialises its children's weights


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            "zeroplus": {"memory_estimate": False, "log_level": "warning"}}


def _builders() -> dict:
    return {"gpt": lambda: GPT(gpt_config("tiny", n_layer=6)),
            "llama": lambda: build("llama", "tiny"), "gpt2": lambda: build("gpt2", "tiny")}


def _build_job(family: str, stage: int) -> dict:
    rank, world = rank_and_world()
    make = _builders()[family]
    torch.manual_seed(0)
    whole = make()
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in whole.modules())
    reference = zeroplus.initialize(whole, _config(stage))
    expected = {k: v.clone() for k, v in whole.state_dict().items()}
    expected_losses = train_losses(reference, hugging_face=family != "gpt", vocab=256, seq=16, seed=7)
    before = reference.dp.bytes_sent.get("all_to_all", 0)  # (the data group object is shared between engines)
    reference.destroy()

    torch.manual_seed(0)
    with NewStorageBytes() as built:
        with zeroplus.Init(config_dict_or_path=_config(stage), max_gathered_bytes=WINDOW):
            model = make()
    shard_bytes = sum(shard_of(p).values.numel() * p.element_size() for p in model.parameters())
    tied = family == "gpt2" and model.lm_head.weight is model.transformer.wte.weight
    engine = zeroplus.initialize(model, _config(stage))
    moved = engine.dp.bytes_sent.get("all_to_all", 0) - before  # ZeRO-3: parts cut from the chunks, nothing regathered
    got = model.state_dict()
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]  # before training moves them
    losses = train_losses(engine, hugging_face=family != "gpt", vocab=256, seq=16, seed=7)
    return {"differ": differ, "names": len(expected), "losses": (expected_losses, losses), "tied": tied,
            "peak": built.peak, "shards": shard_bytes, "moved": moved, "whole": whole_bytes, "largest": largest,
            "world": world}


CASES = [("gpt", 3), ("llama", 3), ("gpt2", 3), ("gpt2", 1)]


def _all_builds() -> tuple[list[dict], dict]:
    return [_build_job(family, stage) for family, stage in CASES], _gathered_job()


def test_built_under_init_equals_built_whole_and_gathered_parameters():
    outcomes = run_distributed(_all_builds, 2)
    _check_gathered([g for _, g in outcomes])
    for results, _ in outcomes:
        for (family, stage), r in zip(CASES, results):
            assert r["names"] > 0 and r["differ"] == [], (family, stage, r["differ"])
            assert r["losses"][0] == r["losses"][1], (family, stage)  # bit for bit, both steps
            assert r["tied"] == (family == "gpt2")
            assert (r["moved"] > 0) == (stage == 3), (family, stage, r["moved"])
            # building held the shards, one module's own parameters, the gathered window, never the model
            assert r["peak"] <= r["shards"] + 2 * r["largest"] + 2 * WINDOW, r
            assert r["peak"] < r["whole"], r


def _gathered_job() -> dict:
    rank, _ = rank_and_world()
    torch.manual_seed(rank)  # different on each rank: Init keeps rank 0's values
    with zeroplus.Init():
        layer = torch.nn.Linear(5, 3)
    out: dict = {"placeholder_nan": bool(torch.isnan(layer.weight.detach()).all())}
    with zeroplus.GatheredParameters([layer.weight, layer.bias]):
        out["read"] = layer.weight.detach().clone()
    with zeroplus.GatheredParameters(layer.weight, modifier_rank=1):
        layer.weight.data.fill_(float(rank + 1))  # rank 1's write is the one kept
    with zeroplus.GatheredParameters(layer.weight):
        out["after"] = layer.weight.detach().clone()
    try:
        with zeroplus.GatheredParameters(layer.bias), torch.no_grad():
            layer.bias.mul_(2.0)
    except ValueError as err:
        out["read_only"] = str(err)
    try:
        with zeroplus.GatheredParameters(layer.weight, modifier_rank=0):
            with zeroplus.GatheredParameters(layer.weight, modifier_rank=1):
                pass
    except ValueError as err:
        out["nested"] = str(err)
    for stage in (3, 1):  # an engine's parameters: its units gathered, a change kept in the masters
        torch.manual_seed(0)
        model = GPT(gpt_config("tiny"))
        cfg = _config(stage)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every unit released after use
        engine = zeroplus.initialize(model, cfg)
        expected = engine.partition.consolidated_fp32_state()["blocks.1.attn.qkv.weight"]
        weight = model.blocks[1].attn.qkv.weight
        with zeroplus.GatheredParameters([weight, model.blocks[1].attn.proj.weight]):
            out[f"engine_read{stage}"] = torch.equal(weight.detach(), expected)
        with zeroplus.GatheredParameters(weight, modifier_rank=1):
            weight.data.fill_(float(rank + 3))
        out[f"engine_write{stage}"] = torch.equal(
            engine.partition.consolidated_fp32_state()["blocks.1.attn.qkv.weight"], torch.full_like(expected, 4.0))
        out[f"engine_freed{stage}"] = weight.untyped_storage().nbytes() == 0 if stage == 3 else True
        engines = [engine, zeroplus.initialize(GPT(gpt_config("tiny")), cfg)]
        try:
            with zeroplus.GatheredParameters([e.module.wte.weight for e in engines]):
                pass
        except ValueError as err:
            out["two_engines"] = str(err)
    return out


def _check_gathered(results: list[dict]) -> None:
    for r in results:
        assert r["placeholder_nan"]
        assert torch.equal(r["read"], results[0]["read"])  # every rank reads rank 0's construction
        assert torch.equal(r["after"], torch.full((3, 5), 2.0))
        assert "modifier_rank=None) is read only" in r["read_only"] and "(3,)" in r["read_only"]
        assert "already gathered with modifier_rank=0" in r["nested"] and "modifier_rank=1" in r["nested"]
        for stage in (3, 1):
            assert r[f"engine_read{stage}"] and r[f"engine_write{stage}"] and r[f"engine_freed{stage}"], (stage, r)
        assert "belong to 2 different engines" in r["two_engines"]
