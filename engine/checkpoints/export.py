"""Consolidated exports: a checkpoint's plain fp32 state dict, without launching any rank; the live engine's
whole model in its compute dtype in one file (``save_16bit_model``).

``load_fp32_state_dict(dir, tag)`` reassembles every trainable parameter from the ranges the
rank files hold (checksums verified), adds rank 0's frozen parameters and buffers, and repeats
tied weights under every name the plain model's ``state_dict`` uses, so
``model.load_state_dict(sd, strict=True)`` works. Memory: the whole model in fp32 plus one rank
file at a time.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from zeroplus.zero.frozen_values import read_frozen

from . import files as io
from .split_export import joined_checkpoint, split_by_plans

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses


def load_fp32_state_dict(ckpt_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    tag = io.resolve_tag(ckpt_dir, tag)
    path = os.path.join(ckpt_dir, tag)
    meta = io.read_metadata(path)
    if split_by_plans(meta):  # a Hugging Face model split by its plans, joined (refused where it was split otherwise)
        meta, tensors, mapped = joined_checkpoint(path, meta)
        out = {name: value.float() for name, value in tensors}
        extra = {name: value.clone() for name, value in mapped.items()}  # (owned: the rank files are mapped)
    else:
        out, extra = _whole_groups(path, meta)
    for name, value in io.exported_extra(meta, extra, path).items():
        out[name] = value.float() if value.is_floating_point() else value
    for alias, name in meta.get("aliases", {}).items():
        out[alias] = out[name].clone()
    return out


def _whole_groups(path: str, meta: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every flat group's parameters whole from the rank files, and rank 0's ``module_extra``."""
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
    return out, files.get(0, {}).get("module_extra", {})


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


def save_16bit_model(engine: Engine, save_dir: str, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> str | None:
    """``Engine.save_16bit_model``: the whole model in the compute dtype in one file written by rank 0 (every rank
    calls it: at stages 1-3 the masters are all-gathered, one model's worth in fp32 on each rank). Returns the path
    on rank 0, None elsewhere. ``exclude_frozen_parameters``: the trained parameters and the buffers only."""
    par = engine.parallel
    if par is not None and (par.model.size > 1 or par.expert.size > 1):
        raise ValueError(f"save_16bit_model() writes one whole model, and this run splits it ("
                         f"{par.topology.describe()}; rank {par.global_rank} holds a slice): consolidating "
                         f"slices is not built; use save_checkpoint()")
    state = engine.partition.consolidated_fp32_state()
    frozen: dict[str, torch.Tensor] = {}  # stage 3's frozen groups (every rank gathers them)
    if not exclude_frozen_parameters:
        frozen = read_frozen(engine.partition.frozen, engine.accelerator.host_copy if engine.dp.rank == 0 else None)
    if engine.dp.rank != 0:
        engine.dp.barrier()
        return None
    dtype = engine.partition.groups[0].compute_dtype if engine.partition.groups else torch.float32
    out = {n: t.to(dtype) for n, t in state.items()}
    trainable = {id(p) for g in engine.partition.groups for p in g.params}
    canonical = {id(p): n for n, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) not in trainable:
            if not exclude_frozen_parameters:
                own = frozen.get(canonical[id(p)])
                out[name] = own if own is not None else engine.accelerator.host_copy(p)
        elif canonical[id(p)] != name:
            out[name] = out[canonical[id(p)]].clone()  # tied weight, under each of its names
    skip = set(io.non_persistent_buffers(engine.module))  # the model's own state_dict() keys, as DeepSpeed writes
    out.update({n: engine.accelerator.host_copy(b) for n, b in engine.module.named_buffers() if n not in skip})
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, save_filename)
    write_state_dict(out, path)
    engine.dp.barrier()
    return path

