"""Consolidated exports of a checkpoint: a plain fp32 state dict, without launching any rank.

``load_fp32_state_dict(dir, tag)`` reassembles every trainable parameter from the ranges the
rank files hold (checksums verified), adds rank 0's frozen parameters and buffers, and repeats
tied weights under every name the plain model's ``state_dict`` uses, so
``model.load_state_dict(sd, strict=True)`` works. Memory: the whole model in fp32 plus one rank
file at a time.
"""
from __future__ import annotations

import math
import os

import torch

from . import files as io


def load_fp32_state_dict(ckpt_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    tag = io.resolve_tag(ckpt_dir, tag)
    path = os.path.join(ckpt_dir, tag)
    meta = io.read_metadata(path)
    if "parts" in meta:
        top = meta["topology"]
        raise ValueError(f"checkpoint {path} holds a model split over tensor {top['tensor']} x pipeline "
                         f"{top['pipeline']} ranks (slices {meta['parts']}); consolidating the slices into one "
                         f"state dict is not supported yet: load it with the same tensor and pipeline sizes")
    experts = sorted({p[0] for g in meta["groups"] for p in g["params"] if "@ep" in p[0]})
    if experts:
        raise ValueError(f"checkpoint {path} holds experts split over {meta['topology']['expert']} expert-parallel "
                         f"ranks ({experts[0]}, ...); consolidating them into one state dict is not supported yet: "
                         f"load it with the same expert-parallel size")
    files: dict[int, dict] = {}
    flats = {g["name"]: torch.zeros(g["numel"], dtype=torch.float32) for g in meta["groups"]}
    for rank_str, digest in sorted(meta["files"].items(), key=lambda kv: int(kv[0])):
        rank = int(rank_str)
        state = io.load_rank_state(path, rank, digest)
        for g in meta["groups"]:
            saved = state["groups"][g["name"]]
            flats[g["name"]][saved["lo"]:saved["hi"]].copy_(saved["master"])
        if rank == 0:
            files[0] = {"module_extra": state["module_extra"]}
        del state
    out: dict[str, torch.Tensor] = {}
    for g in meta["groups"]:
        flat = flats[g["name"]]
        for name, shape, offset in g["params"]:
            numel = math.prod(shape)
            out[name] = flat[offset:offset + numel].view(shape).clone()
    for name, value in io.exported_extra(meta, files.get(0, {}).get("module_extra", {}), path).items():
        out[name] = value.float() if value.is_floating_point() else value
    for alias, name in meta.get("aliases", {}).items():
        out[alias] = out[name].clone()
    return out


def write_state_dict(state: dict[str, torch.Tensor], out_path: str) -> None:
    """``.safetensors`` or ``.pt`` by extension, written to a temporary file and renamed."""
    tmp = out_path + ".tmp"
    if out_path.endswith(".safetensors"):
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, tmp)
    elif out_path.endswith((".pt", ".bin", ".pth")):
        torch.save(state, tmp)
    else:
        raise ValueError(f"output {out_path!r} must end in .safetensors, .pt, .pth or .bin")
    os.replace(tmp, out_path)
