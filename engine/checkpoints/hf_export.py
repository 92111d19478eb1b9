"""Hugging Face exports: sharded safetensors and their index, from a checkpoint or from the live engine.

The layout ``from_pretrained`` and every serving stack read: ``model-00001-of-0000N.safetensors`` files of at
most ``max_shard_size`` bytes each (a tensor larger than that is a file alone), ``model.safetensors.index.json``
mapping every tensor name to its file, and a single ``model.safetensors`` without an index when everything fits
in one file; ``config.json`` beside them when the model had a Hugging Face config (a checkpoint keeps it in
its metadata). Names are the model's ``state_dict`` names with tied weights once (the name the model reaches
first, as Transformers saves them); values in ``dtype`` (fp32 masters cast; buffers and integer tensors keep
their own dtype).

Memory, bounded by one file: ``ShardWriter`` holds the tensors of the file being filled and writes it when the
next tensor would overflow it. ``export_checkpoint`` (``zeroplus convert --format hf``, no ranks) maps each rank
file (``torch.load(mmap=True)`` after its SHA-256 is checked, streamed) and copies each parameter's ranges out
of the mapped masters, so only the pages it reads are resident (page cache, not the process's own memory)
beside one output file. ``save_pretrained`` (the live engine, every rank) all-gathers one flat group's masters
at a time (a collective in the same order on every rank: fp32, the group's padded size) and rank 0 feeds the
writer; stage 3's frozen groups are gathered one at a time the same way. The files appear under temporary
names and are renamed into place, the index last.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Iterator

import torch

from zeroplus.config import parse_bytes
from zeroplus.parallel.plan_slices import slicing, whole
from zeroplus.zero.frozen_values import read_frozen

from . import files as io
from .split_export import joined_checkpoint, split_by_plans

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses

INDEX = "model.safetensors.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: one of {sorted(DTYPES)}")
    return DTYPES[name]


def shard_bytes(size: str | int) -> int:
    """``max_shard_size`` as Hugging Face writes it (``"5GB"``, ``"500MB"``, a number of bytes)."""
    value = parse_bytes(size)
    if value < 1:
        raise ValueError(f"max_shard_size {size!r} must be a positive number of bytes")
    return value


class ShardWriter:
    """Fill one file at a time; ``finish()`` names them ``-of-N`` and writes the index. ``peak_bytes``: the most
    tensor bytes it held at once (at most ``max(max_shard_bytes, the largest tensor)``)."""

    def __init__(self, out_dir: str, max_shard_bytes: int, dtype: torch.dtype) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.max_shard_bytes, self.dtype = out_dir, max_shard_bytes, dtype
        self.tmp = tempfile.mkdtemp(prefix=".hf-export.tmp-", dir=out_dir)
        self.held: dict[str, torch.Tensor] = {}
        self.held_bytes = self.peak_bytes = 0
        self.files: list[list[str]] = []  # the names in each file written
        self.total_bytes = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        if name in self.held or any(name in names for names in self.files):
            raise ValueError(f"tensor {name!r} exported twice")
        out = value.detach().to(self.dtype) if value.is_floating_point() else value.detach()
        out = out.contiguous().clone() if out.data_ptr() == value.data_ptr() else out.contiguous()
        size = out.numel() * out.element_size()
        if self.held and self.held_bytes + size > self.max_shard_bytes:
            self._flush()
        self.held[name] = out
        self.held_bytes += size
        self.total_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _flush(self) -> None:
        from safetensors.torch import save_file
        save_file(self.held, os.path.join(self.tmp, f"part-{len(self.files)}.safetensors"), metadata={"format": "pt"})
        self.files.append(sorted(self.held))
        self.held, self.held_bytes = {}, 0

    def finish(self, config: dict[str, Any] | None) -> list[str]:
        """Rename the files into place (the index, then ``config.json``, last); return their names."""
        if self.held:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for k, name in enumerate(names):
            os.replace(os.path.join(self.tmp, f"part-{k}.safetensors"), os.path.join(self.out_dir, name))
        stale = os.path.join(self.out_dir, INDEX)
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {t: names[k] for k, ts in enumerate(self.files) for t in ts}}
            tmp = os.path.join(self.tmp, INDEX)
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            os.replace(tmp, stale)
        elif os.path.exists(stale):  # an earlier export's index would point at files of another split
            os.remove(stale)
        if config is not None:
            tmp = os.path.join(self.tmp, "config.json")
            with open(tmp, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
            os.replace(tmp, os.path.join(self.out_dir, "config.json"))
        shutil.rmtree(self.tmp, ignore_errors=True)
        return names


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """Tied weights: each further name the plain ``state_dict`` uses for a parameter, mapped to its first."""
    canonical = {id(p): n for n, p in module.named_parameters()}
    return {n: canonical[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}


def whole_model_checkpoint(ckpt_dir: str, tag: str | None, what: str) -> tuple[dict[str, Any], dict[int, Any]]:
    """The metadata and every rank file (mapped) of a checkpoint of one whole model, for an export ``what``."""
    tag = io.resolve_tag(ckpt_dir, tag)
    path = os.path.join(ckpt_dir, tag)
    meta = io.read_metadata(path)
    if "parts" in meta or any("@ep" in p[0] for g in meta["groups"] for p in g["params"]):
        raise ValueError(f"checkpoint {path} holds a model split over tensor, pipeline or expert ranks; a {what} "
                         f"export of one whole model from slices is built only for a Hugging Face model split by "
                         f"its plans (AutoTP, AutoEP), to Hugging Face files (--format hf)")
    return meta, {int(r): io.map_rank_state(path, int(r), d) for r, d in meta["files"].items()}


def export_checkpoint(ckpt_dir: str, out_dir: str, tag: str | None = None, dtype: str = "fp32",
                      max_shard_size: str | int = "5GB") -> tuple[list[str], int]:
    """``zeroplus convert CKPT OUT_DIR --format hf``: the files written and the writer's peak tensor bytes. A
    checkpoint of a Hugging Face model split by its plans (AutoTP's parts, AutoEP's expert groups) is joined back
    into the whole model, one tensor at a time (``split_export.py``)."""
    path = os.path.join(ckpt_dir, io.resolve_tag(ckpt_dir, tag))
    top = io.read_metadata(path)
    if split_by_plans(top):
        meta, tensors, extra = joined_checkpoint(path, top)
    else:
        meta, ranks = whole_model_checkpoint(ckpt_dir, tag, "Hugging Face")
        tensors, extra = _whole_tensors(meta, ranks), ranks[0]["module_extra"]
    writer = ShardWriter(out_dir, shard_bytes(max_shard_size), export_dtype(dtype))
    try:
        for name, value in tensors:
            writer.add(name, value)
        for name, value in io.exported_extra(meta, extra, ckpt_dir).items():
            writer.add(name, value)
        return writer.finish(meta.get("hf_config")), writer.peak_bytes
    finally:
        shutil.rmtree(writer.tmp, ignore_errors=True)


def _whole_tensors(meta: dict[str, Any], ranks: dict[int, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for g in meta["groups"]:
        pieces = [(s["lo"], s["hi"], s["master"]) for s in (ranks[r]["groups"][g["name"]] for r in sorted(ranks))]
        for name, shape, offset in g["params"]:
            yield name, io.whole_parameter(pieces, offset, math.prod(shape)).view(shape)


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for prefix, m in module.named_modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), b


def hf_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """The model's Hugging Face config as ``config.json`` holds it, when it has one."""
    config = getattr(module, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return json.loads(to_json()) if callable(to_json) else None


def _slicing(engine: Engine) -> Any:
    """Each parameter's slicing (the slices ``save_pretrained`` puts back together: a Hugging Face model split by its
    plans, ``parallel/plan_slices.py``), None where the model is not split; a ValueError where it is split some other
    way (slices it cannot join)."""
    try:
        return slicing(engine.module, engine.parallel, "save_pretrained() writes one whole model")
    except ValueError as err:
        raise ValueError(f"{err}; use save_checkpoint()") from None


def _barrier(engine: Engine, tensor: Any) -> None:
    """Every rank that took part waits for rank 0's files."""
    engine.dp.barrier()
    if tensor is not None:
        tensor.barrier()


def save_pretrained(engine: Engine, out_dir: str, dtype: str | None = None,
                    max_shard_size: str | int = "5GB") -> list[str] | None:
    """Every rank calls it; rank 0 writes ``out_dir`` and returns the file names (None elsewhere). ``dtype``:
    ``fp32``, ``bf16`` or ``fp16`` (default: the compute dtype)."""
    of = _slicing(engine)
    par = engine.parallel
    tensor = par.tensor if of is not None and par is not None and par.tensor.size > 1 else None
    part = engine.partition
    compute = part.groups[0].compute_dtype if part.groups else torch.float32
    chosen = {v: k for k, v in DTYPES.items()}.get(compute, "fp32") if dtype is None else dtype
    first = engine.dp.rank == 0 and (tensor is None or tensor.rank == 0)
    writer = ShardWriter(out_dir, shard_bytes(max_shard_size), export_dtype(chosen)) if first else None
    try:
        module = engine.module
        named = {id(p): n for n, p in module.named_parameters()}  # (an expert group's names carry @epN)
        for g in part.groups:  # one group's fp32 masters at a time, on every rank (a collective)
            flat = g.gather_master()
            for p, offset, numel, shape in zip(g.params, g.offsets, g.numels, g.shapes):
                value = flat[offset:offset + numel].view(shape)
                cut = of(p) if of is not None else None
                if cut is not None:  # a slice: every rank's of its group, put back together (a collective)
                    slices = torch.empty(cut.group.size * numel, dtype=value.dtype, device=value.device)
                    cut.group.all_gather(slices, value.reshape(-1)).wait()
                    value = whole(slices, shape, cut.cut)
                if writer is not None:
                    writer.add(named[id(p)], value)
            del flat
        for g in part.frozen:  # stage 3's frozen groups, one at a time
            for name, value in read_frozen([g], engine.accelerator.host_copy if writer else None).items():
                if writer is not None:
                    writer.add(name, value)
        if writer is not None:
            flat_ids = {id(p) for g in part.groups + part.frozen for p in g.params}
            for name, p in module.named_parameters():
                if id(p) not in flat_ids:  # never partitioned (frozen at stages 0-2)
                    writer.add(name, engine.accelerator.host_copy(p))
            for name, b in _persistent_buffers(module):
                writer.add(name, engine.accelerator.host_copy(b))
            names = writer.finish(hf_config(module))
            _barrier(engine, tensor)
            return names
        _barrier(engine, tensor)
        return None
    finally:
        if writer is not None:
            shutil.rmtree(writer.tmp, ignore_errors=True)
