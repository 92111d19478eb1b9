"""A checkpoint of a Hugging Face model split by its own plans, joined back into the whole model offline
(``zeroplus convert CKPT OUT`` to one state dict or ``--format hf``; no ranks, no process group).

An AutoTP run writes one part per tensor rank (``tpTT_pp00``: each a checkpoint of its slices over its data
group); an AutoEP run writes one checkpoint whose expert groups carry ``@epE`` (each expert rank's experts over its
expert-data group). Each part's metadata lists, by whole-model name, how the plan cut each parameter (``cuts``:
kind, dim, packed, as ``plan_slices.Cut``), written only where the model is split by its plans alone (a model split
by zeroplus's own tensor-parallel or MoE layers writes ``None``: its slices have no whole-model names). Each slice
is read from the rank files its group's ``ranges`` name (``files.whole_parameter``), and the slices are joined in
rank order as ``save_pretrained`` joins them live (``plan_slices.whole``), one whole tensor at a time: memory is
one whole tensor and its slices beside the mapped files. Refused, naming the checkpoint: pipeline stages, a model
split some other way or saved before the cuts were recorded, and a cut parameter held outside the flat groups (a
frozen slice: rank 0's file holds its own only).
"""
from __future__ import annotations

import math
import os
from typing import Any, Iterator

import torch

from zeroplus.parallel.plan_slices import Cut, whole

from . import files as io


def split_by_plans(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint's metadata is of a model split over tensor ranks (parts) or expert ranks (``@ep``)."""
    return "parts" in meta or any("@ep" in p[0] for g in meta.get("groups", []) for p in g["params"])


def _base(name: str) -> str:
    return name.split("@ep")[0]


def joined_checkpoint(path: str, top: dict[str, Any]) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]],
                                                                dict[str, Any]]:
    """A split checkpoint's (first part's) metadata, every parameter whole by its name (a generator: one at a
    time), and rank 0's ``module_extra``; a ``ValueError`` naming the checkpoint where it cannot be joined. ``top``:
    the metadata at ``path``."""
    if top.get("topology", {}).get("pipeline", 1) > 1:
        raise ValueError(f"checkpoint {path} holds pipeline stages ({top.get('parts')}); joining them into one "
                         f"model is not supported: load it with the same pipeline size")
    parts = [os.path.join(path, p) for p in top["parts"]] if "parts" in top else [path]
    metas = [io.read_metadata(p) for p in parts] if "parts" in top else [top]
    for where, meta in zip(parts, metas):
        if meta.get("cuts") is None:
            raise ValueError(f"checkpoint {where} does not record how its model was cut (a model split by zeroplus's "
                             f"own tensor-parallel or MoE layers, or a checkpoint written before zeroplus recorded "
                             f"the cuts): only a Hugging Face model split by its plans (AutoTP, AutoEP) is joined; "
                             f"load it with the same tensor and expert sizes")
    cuts = {n: (kind, Cut(dim, packed)) for n, (kind, dim, packed) in metas[0]["cuts"].items()}
    files = [{int(r): io.map_rank_state(p, int(r), d) for r, d in m["files"].items()} for p, m in zip(parts, metas)]
    extra = files[0][0]["module_extra"]
    held = sorted(set(extra) & set(cuts))
    if held:
        raise ValueError(f"checkpoint {path} holds parameters a plan cut outside its flat groups ({held[:4]}: frozen "
                         f"slices, whose other ranks' files do not keep them); joining them is not supported")
    return metas[0], _joined(metas, files, cuts), extra


def _read(files: dict[int, Any], group: dict[str, Any], shape: list[int], offset: int) -> torch.Tensor:
    """One parameter (one slice) from the ranges of its flat group the rank files hold."""
    saved = [files[file_rank]["groups"][group["name"]] for file_rank, *_ in group["ranges"]]
    pieces = [(s["lo"], s["hi"], s["master"]) for s in saved]
    return io.whole_parameter(pieces, offset, math.prod(shape)).view(shape)


def _joined(metas: list[dict[str, Any]], files: list[dict[int, Any]],
            cuts: dict[str, tuple[str, Cut]]) -> Iterator[tuple[str, torch.Tensor]]:
    index = [{name: (g, shape, offset) for g in m["groups"] for name, shape, offset in g["params"]} for m in metas]
    named: dict[str, list[str]] = {}  # whole names, in the order the first part lists them: its saved names
    for n in index[0]:
        named.setdefault(_base(n), []).append(n)
    for name, saved in named.items():
        found = cuts.get(name)
        if found is None:  # whole on every part
            yield name, _read(files[0], *index[0][name])
            continue
        kind, cut = found
        if kind == "tensor":  # one slice per part, in tensor rank order
            slices = [_read(f, *ix[name]) for f, ix in zip(files, index)]
        else:  # one slice per expert rank, each its own group's
            ranked = sorted(saved, key=lambda n: int(n.split("@ep")[1]))
            slices = [_read(files[0], *index[0][n]) for n in ranked]
        yield name, whole(torch.cat([s.reshape(-1) for s in slices]), slices[0].shape, cut)


__all__ = ["joined_checkpoint", "split_by_plans"]
