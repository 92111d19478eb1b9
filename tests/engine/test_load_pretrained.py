"""``engine.load_pretrained`` reads a Hugging Face checkpoint (safetensors or .bin, one file or sharded)
straight into the shards of a model that never existed whole (built on the meta device): the engine then
equals ``load_state_dict`` before ``initialize``, bit for bit, and trains the same; its checkpoints
convert as before. Names are strict, shapes are checked, and a refused load changes nothing."""
from __future__ import annotations

import os

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import build
from tests.models import train_losses
from tests.new_storage import NewStorageBytes


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            "zeroplus": {"memory_estimate": False, "log_level": "error"}}


def _save(family: str, folder: str, safe: bool) -> str:
    rank, _ = rank_and_world()
    path = os.path.join(folder, f"{family}-{'st' if safe else 'bin'}")
    if rank == 0:
        torch.manual_seed(123)
        build(family).save_pretrained(path, safe_serialization=safe, max_shard_size="100KB")
    torch.distributed.barrier()
    return path


def _losses(engine: zeroplus.Engine) -> list[float]:
    torch.manual_seed(99)  # GPT-2 trains with dropout
    return train_losses(engine, hugging_face=True, vocab=256, seq=12, seed=5)


def _case(family: str, stage: int, safe: bool, folder: str) -> dict:
    path = _save(family, folder, safe)
    torch.manual_seed(0)
    reference = build(family)
    reference.load_state_dict(type(reference).from_pretrained(path).state_dict())
    engine = zeroplus.initialize(reference, _config(stage))
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    expected_losses = _losses(engine)
    engine.destroy()
    with torch.device("meta"):
        model = build(family)
    engine = zeroplus.initialize(model, _config(stage))
    with NewStorageBytes() as read:
        result = engine.load_pretrained(path)
    got = model.state_dict()
    shard = sum(g.owned_numel for g in engine.partition.groups) * 4
    largest = max(p.numel() for p in model.parameters()) * 4
    out = {"differ": [k for k in expected if not torch.equal(expected[k], got[k])], "n": len(expected),
           "losses": (expected_losses, _losses(engine)), "loaded": len(result.loaded),
           "files": sorted(os.listdir(path)), "read_peak": read.peak, "bound": shard + largest}
    ckpt = os.path.join(folder, f"ckpt-{family}-{stage}-{safe}")
    engine.save_checkpoint(ckpt)
    consolidated = zeroplus.load_fp32_state_dict(ckpt)
    out["converted"] = all(torch.equal(consolidated[k].float(), v.float())
                           for k, v in model.state_dict().items() if k in consolidated)
    return out


def _cases(folder: str) -> tuple[list[dict], dict]:
    return [_case(*case, folder) for case in CASES], _refusals(folder)


CASES = [("llama", 3, True), ("llama", 1, False), ("gpt2", 3, True)]


def test_pretrained_weights_go_straight_into_shards_and_bad_ones_are_refused(tmp_path):
    outcomes = run_distributed(_cases, 2, str(tmp_path))
    _check_refusals([r for _, r in outcomes])
    for results, _ in outcomes:
        for case, r in zip(CASES, results):
            assert r["n"] > 0 and r["differ"] == [], (case, r["differ"])
            assert r["losses"][0] == r["losses"][1], case
            assert r["converted"], case
            assert any(f.endswith(".index.json") for f in r["files"]), r["files"]  # sharded files
            # a rank reads its shard of each parameter, never the model: at most its shard plus one tensor
            assert r["read_peak"] <= r["bound"], (case, r["read_peak"], r["bound"])


def _refusals(folder: str) -> dict:
    path = _save("llama", folder, True)
    with torch.device("meta"):
        model = build("llama")
    engine = zeroplus.initialize(model, _config(3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = {}
    wider = os.path.join(folder, "wider")
    if rank_and_world()[0] == 0:
        torch.manual_seed(1)
        tf_model = build("llama")
        tf_model.config.vocab_size = 300
        tf_model.resize_token_embeddings(300, mean_resizing=False)
        tf_model.save_pretrained(wider)
        build("llama").model.save_pretrained(os.path.join(folder, "base"))  # LlamaModel: no 'model.', no head
    torch.distributed.barrier()
    for key, kwargs in {"shape": {"path": wider}, "names": {"path": path, "prefixes": {"model.": "base."}}}.items():
        try:
            engine.load_pretrained(**kwargs)
        except ValueError as err:
            out[key] = str(err)
    cut = os.path.join(folder, "cut")
    if rank_and_world()[0] == 0:
        os.makedirs(cut)
        build("llama").save_pretrained(cut)  # one file: then cut its end off
        whole = os.path.join(cut, "model.safetensors")
        with open(whole, "r+b") as f:
            f.truncate(os.path.getsize(whole) - 100)
    torch.distributed.barrier()
    try:
        engine.load_pretrained(cut)
    except ValueError as err:
        out["truncated"] = str(err)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    renamed = engine.load_pretrained(os.path.join(folder, "base"), prefixes={"": "model."},
                                     allow_missing=["lm_head.*"])
    out["allowed"] = renamed.missing
    return out


def _check_refusals(results: list[dict]) -> None:
    for r in results:
        assert "parameter model.embed_tokens.weight: shape (300, 64) in" in r["shape"] and "(256, 64) in the model" \
            in r["shape"], r["shape"]
        assert "missing model.embed_tokens.weight" in r["names"] and "unexpected ['base.embed_tokens.weight'" \
            in r["names"], r["names"]
        assert "Nothing was loaded" in r["names"] and r["unchanged"]
        assert r["allowed"] == ["lm_head.weight"]
        assert "model.safetensors is truncated" in r["truncated"], r["truncated"]
