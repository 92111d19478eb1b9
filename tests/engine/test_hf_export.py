"""Hugging Face exports (issue 39 item 1): ``zeroplus convert CKPT OUT --format hf`` and ``engine.save_pretrained``.

A tiny GPT-2 (tied head) trained 2 steps at ZeRO-3 on 2 gloo ranks, then exported with a small
``max_shard_size`` so the export takes several files: the files, the index and ``config.json`` are there;
``from_pretrained`` loads them with no missing, unexpected or mismatched key; every parameter equals the
engine's consolidated fp32 master bitwise (fp32 export) or its bf16 cast (bf16 export); the tied head is
written once; the live export and the offline conversion hold the same tensors; the writer never held more
than one file's tensors (or the largest tensor, alone in its file).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import build

SHARD = 60_000  # bytes: the tiny GPT-2 (about 0.4 MB in fp32) in several files


def _job(root: str) -> dict:
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(build("gpt2", "tiny"), cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    names = engine.save_pretrained(os.path.join(root, "live"), max_shard_size=SHARD)
    engine.save_pretrained(os.path.join(root, "live-bf16"), dtype="bf16", max_shard_size=SHARD)
    return {"names": names, "masters": engine.consolidated_fp32_state()}


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, f)))
    return out


def _loaded(directory: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, dtype=dtype)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return {n: p.detach() for n, p in model.named_parameters()}


def test_a_sharded_hugging_face_export_loads_with_from_pretrained_and_equals_the_masters(tmp_path):
    root = str(tmp_path)
    rank0 = run_distributed(_job, 2, root)[0]
    masters = rank0["masters"]
    done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", os.path.join(root, "ckpt"),
                           os.path.join(root, "converted"), "--format", "hf", "--max-shard-size", str(SHARD)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peak = int(done.stdout.split("at most ")[1].split(" tensor")[0].replace(",", ""))
    largest = max(4 * t.numel() for t in masters.values())
    assert peak <= max(SHARD, largest), (peak, SHARD, largest)
    for name in ("live", "converted"):
        directory = os.path.join(root, name)
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
        with open(os.path.join(directory, "model.safetensors.index.json")) as f:
            index = json.load(f)
        assert sorted(set(index["weight_map"].values())) == files
        with open(os.path.join(directory, "config.json")) as f:
            assert json.load(f)["model_type"] == "gpt2"
        saved = _tensors(directory)
        assert "lm_head.weight" not in saved and "transformer.wte.weight" in saved, "the tied head once"
        loaded = _loaded(directory, torch.float32)
        for key, value in masters.items():
            assert torch.equal(loaded[key], value), f"{name}: {key}"
    assert rank0["names"] == sorted(f for f in os.listdir(os.path.join(root, "live")) if f.endswith(".safetensors"))
    live, converted = _tensors(os.path.join(root, "live")), _tensors(os.path.join(root, "converted"))
    assert sorted(live) == sorted(converted)
    for key, value in live.items():
        assert torch.equal(value, converted[key]), key
    half = _loaded(os.path.join(root, "live-bf16"), torch.bfloat16)
    for key, value in masters.items():
        assert half[key].dtype == torch.bfloat16 and torch.equal(half[key], value.to(torch.bfloat16)), key
