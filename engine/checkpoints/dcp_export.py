"""A zeroplus checkpoint as a ``torch.distributed.checkpoint`` (DCP) one, for FSDP2 and torchtitan to load.

``zeroplus convert CKPT OUT_DIR --format dcp`` (no ranks) writes, with ``dcp.save`` in one process, the state
dict that ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` gives an FSDP2 model
trained with torch's AdamW, under two keys: ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {"step",
"exp_avg", "exp_avg_sq", ...}}, "param_groups": [{..., "params": [fqn, ...]}]}}``. Values are whole fp32
tensors (DCP reshards them at load time: any world size, any FSDP2 mesh); tied weights appear under every
name the model's ``state_dict`` uses, optimizer states under the first (as ``named_parameters`` gives them);
a parameter-group's hyper-parameters are the ones the checkpoint saved (torch's AdamW keys: the loader asks
for every key its own optimizer has). Frozen parameters and buffers come from rank 0's file. Loading::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=OUT_DIR)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Memory: the whole model's fp32 masters and optimizer states (DCP writes one file from the whole state dict),
read from the mapped rank files.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from . import files as io
from .dcp_save import param_group_of
from .hf_export import whole_model_checkpoint


def export_dcp(ckpt_dir: str, out_dir: str, tag: str | None = None) -> int:
    """Write ``out_dir`` (a DCP checkpoint); return the number of model tensors."""
    meta, ranks = whole_model_checkpoint(ckpt_dir, tag, "DCP")
    hparams = ranks[0]["optimizer_hparams"]
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    params: dict[int, list[str]] = {i: [] for i in range(len(hparams))}
    for g in meta["groups"]:
        gi = param_group_of(g["name"])
        saved = [ranks[r]["groups"][g["name"]] for r in sorted(ranks)]
        masters = [(s["lo"], s["hi"], s["master"]) for s in saved]
        for name, shape, offset in g["params"]:
            numel = math.prod(shape)
            model[name] = io.whole_parameter(masters, offset, numel).view(shape)
            entry: dict[str, Any] = {k: v.clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                                     for k, v in saved[0]["whole"].items()}
            for key in saved[0]["sliced"]:
                ranges = [(s["lo"], s["hi"], s["sliced"][key]) for s in saved]
                entry[key] = io.whole_parameter(ranges, offset, numel).view(shape)
            state[name] = entry
            params.setdefault(gi, []).append(name)
    for name, value in io.exported_extra(meta, ranks[0]["module_extra"], ckpt_dir).items():
        model[name] = value.clone()
    for alias, name in meta.get("aliases", {}).items():
        model[alias] = model[name]
    groups = [dict(hp, params=params.get(i, [])) for i, hp in enumerate(hparams)]
    os.makedirs(out_dir, exist_ok=True)
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=out_dir,
             no_dist=True)
    return len(model)
