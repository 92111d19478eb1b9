"""Exports people carry: Hugging Face (``zeroplus convert CKPT OUT --format hf``, ``engine.save_pretrained``)
and ``torch.distributed.checkpoint`` (``--format dcp``).

A tiny GPT-2 (tied head) trained 2 steps at ZeRO-3 on 2 gloo ranks, then exported with a small
``max_shard_size`` so the export takes several files: the files, the index and ``config.json`` are there;
``from_pretrained`` loads them with no missing, unexpected or mismatched key; every parameter equals the
engine's consolidated fp32 master bitwise (fp32 export) or its bf16 cast (bf16 export); the tied head is
written once; the live export and the offline conversion hold the same tensors; the writer never held more
than one file's tensors (or the largest tensor, alone in its file). The DCP export of the same checkpoint loads
into FSDP2 (``fully_shard`` per block and root, torch's AdamW) on one rank the way FSDP2 resumes
(``get_state_dict``, ``dcp.load``, ``set_state_dict``): every parameter and both Adam states bitwise, the step.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

import zeroplus
from tests.cli_run import run_cli
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import FAMILIES, build

SHARD = 60_000  # bytes: the tiny GPT-2 (about 0.4 MB in fp32) in several files


def _trained(root: str, **more: dict) -> zeroplus.Engine:
    """A tiny GPT-2 at ZeRO-3 (``more``: config blocks beside), trained 2 steps on this rank's batches and saved
    under ``root/ckpt``."""
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, **more}
    cfg["zeroplus"] = {"log_level": "warning", "memory_estimate": False, **more.get("zeroplus", {})}
    engine = zeroplus.initialize(build("gpt2", "tiny"), cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    return engine


def _job(root: str) -> dict:
    engine = _trained(root)
    names = engine.save_pretrained(os.path.join(root, "live"), max_shard_size=SHARD)
    engine.save_pretrained(os.path.join(root, "live-bf16"), dtype="bf16", max_shard_size=SHARD)
    states = {}  # each parameter's whole Adam states (every rank gathers)
    for grp in engine.partition.groups:
        own = engine.optimizer_state(grp)
        whole = {k: grp.gather_owned(own[k]) for k in ("exp_avg", "exp_avg_sq")}
        for name, offset, numel, shape in zip(grp.names, grp.offsets, grp.numels, grp.shapes):
            states[name] = {k: v[offset:offset + numel].view(shape).clone() for k, v in whole.items()}
    return {"names": names, "masters": engine.consolidated_fp32_state(), "states": states}


def _fsdp2_loads(directory: str) -> dict:
    """FSDP2 (``fully_shard`` per block and root) with torch's AdamW, on one rank: the DCP checkpoint loaded the
    way FSDP2 and torchtitan resume."""
    model = build("gpt2", "tiny")
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    full = StateDictOptions(full_state_dict=True)
    optim = get_optimizer_state_dict(model, optimizer, options=full)["state"]
    return {"model": get_model_state_dict(model, options=full),
            "states": {n: {k: v for k, v in s.items() if k != "step"} for n, s in optim.items()},
            "steps": sorted({float(s["step"]) for s in optim.values()})}


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
    # torch.distributed.checkpoint: what 2 zeroplus ranks saved, FSDP2 on one rank loads (leaving zeroplus)
    done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", os.path.join(root, "ckpt"),
                           os.path.join(root, "dcp"), "--format", "dcp"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    fsdp2 = run_distributed(_fsdp2_loads, 1, os.path.join(root, "dcp"))[0]
    assert fsdp2["steps"] == [2.0]
    for key, value in masters.items():
        assert torch.equal(fsdp2["model"][key], value), f"dcp: {key}"
        for state, ours in rank0["states"][key].items():
            assert torch.equal(fsdp2["states"][key][state], ours), f"dcp: {key} {state}"


def _export_each_family(root: str) -> dict:
    """One rank, ZeRO-3, one step of each family; its checkpoint exported to Hugging Face files and to a plain
    state dict; the keys of the model's own ``state_dict()`` (tied names once, as Transformers saves them)."""
    from engine.checkpoints.export import load_fp32_state_dict
    from engine.checkpoints.hf_export import export_checkpoint
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = build(family, "tiny")
        own = set(model.state_dict())
        engine = zeroplus.initialize(model, {
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3}, "zeroplus": {"log_level": "warning", "memory_estimate": False}})
        ids = torch.randint(0, 256, (1, 8))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        ckpt = os.path.join(root, family, "ckpt")
        engine.save_checkpoint(ckpt)
        engine.destroy()
        export_checkpoint(ckpt, os.path.join(root, family, "hf"))
        out[family] = {"own": own, "fp32": set(load_fp32_state_dict(ckpt)),
                       "hf": set(_tensors(os.path.join(root, family, "hf")))}
    return out


def test_every_family_exports_exactly_its_state_dict_keys(tmp_path):
    """A non-persistent buffer (Llama's ``rotary_emb.original_inv_freq``) is kept by the checkpoint for resuming but
    is no key of ``state_dict()``: the fp32 export holds exactly the model's keys, the Hugging Face export those
    less the tied head, and ``from_pretrained`` reports no missing, unexpected or mismatched key for any family."""
    got = run_distributed(_export_each_family, 1, str(tmp_path))[0]
    for family, keys in got.items():
        assert keys["fp32"] == keys["own"], f"{family}: {keys['fp32'] ^ keys['own']}"
        assert keys["hf"] <= keys["own"] and not {k for k in keys["own"] - keys["hf"] if "lm_head" not in k}, \
            f"{family}: {keys['hf'] ^ keys['own']}"
        _loaded(os.path.join(str(tmp_path), family, "hf"), torch.float32)


def _bf16_masters_job(root: str) -> dict:
    """bf16 training with bf16 master weights (``zeroplus.master_weights``): saved, exported live."""
    engine = _trained(root, bf16={"enabled": True}, zeroplus={"master_weights": {"dtype": "bf16"}})
    engine.save_pretrained(os.path.join(root, "live"))
    return {"masters": engine.consolidated_fp32_state()}


def test_bf16_master_weights_export_to_hugging_face_as_they_are(tmp_path, capsys):
    """With bf16 masters the master is the bf16 weight: the live export and the offline conversion hold it widened
    to fp32 exactly (every value a bf16 value), and ``from_pretrained`` loads both with no key missing."""
    root = str(tmp_path)
    masters = run_distributed(_bf16_masters_job, 2, root)[0]["masters"]
    status, _, err = run_cli(["convert", os.path.join(root, "ckpt"), os.path.join(root, "converted"), "--format",
                              "hf"], capsys)
    assert status == 0, err[-3000:]
    for name in ("live", "converted"):
        loaded = _loaded(os.path.join(root, name), torch.float32)
        for key, value in masters.items():
            assert torch.equal(value, value.to(torch.bfloat16).float()), f"{key}: a master that is not bf16"
            assert torch.equal(loaded[key], value), f"{name}: {key}"
