"""Sharded, elastic checkpoints of an engine: what each rank saves and how a rank loads its part.

Each rank saves, per flat group, its *nominal* range ``[r * S, (r + 1) * S)`` clipped to the
group's unpadded length: the fp32 master values and every optimizer-state tensor of that range
(at stage 0, where a rank holds everything, it still saves only its nominal range, so the files
never repeat each other). Plus: step counters, loss scaler, schedule, optimizer hyper-parameters,
RNG states and the client state; rank 0 also saves buffers and frozen parameters. Low-precision
parameters are not saved: they are the masters rounded. ``metadata.json`` records every group's
parameters (name, shape, offset), which rank saved which range, and each file's SHA-256.

Loading needs only the metadata to know which files hold a rank's new owned range, and matches
parameters by name, so a checkpoint loads at any data-parallel size, ZeRO stage, unit choice or
param-group split (elastic by construction). Memory while
saving: nothing more where a rank's nominal range is a whole buffer it holds (stages 1-3; the file
streams from the tensors themselves), a copy of the nominal range where it is a slice of a larger
buffer (stage 0; fp32 parameters at stages 1-2, whose master is a range of the full flat buffer)
or the master is stored split (shared bf16/fp32 masters merge into fp32);
while loading: the files that overlap this rank's range (kept until the load ends).
"""
from __future__ import annotations

import logging
import os
import random
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zeroplus.comm import DataParallelGroup
from zeroplus.ledger import Category
from zeroplus.parallel.topology import Topology
from zeroplus.zero.flat_group import FlatParamGroup

from . import checkpoint_io as io

logger = logging.getLogger("zeroplus.checkpoint")

# Param-group keys that choose torch's implementation, not the math: this engine keeps its own.
_KERNEL_SWITCHES = frozenset({"fused", "foreach", "capturable", "differentiable"})

if TYPE_CHECKING:
    from .engine import Engine


def _nominal_range(g: FlatParamGroup, rank: int) -> tuple[int, int]:
    lo = min(rank * g.shard_numel, g.numel)
    return lo, min(lo + g.shard_numel, g.numel)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _for_file(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its storage is (nearly) all its own, else a copy: torch.save writes a view's whole
    storage. "Nearly": up to 1/16 more, which covers the alignment padding at the end of the last rank's
    shard (loading reads only the saved range), while a stage-0 rank's half of a flat buffer is copied."""
    own = t.numel() * t.element_size()
    return t if t.untyped_storage().nbytes() - own <= own // 16 else t.clone()


def rank_state(engine: Engine, client_state: dict[str, Any] | None) -> dict[str, Any]:
    """What this rank's file holds (the memory estimate runs it on the meta device for the save phase)."""
    part, opt, rank = engine._partition, engine.optimizer, engine.dp.rank
    groups: dict[str, Any] = {}
    for g in part.groups:
        lo, hi = _nominal_range(g, g.dp.rank)
        a, b = lo - g.owned_start, hi - g.owned_start
        sliced, whole = {}, {}
        for key, value in engine._step.state_of(g).items():
            if isinstance(value, torch.Tensor) and value.numel() == g.owned_numel and value.numel() > 1:
                sliced[key] = _for_file(value[a:b])
            else:
                whole[key] = value
        groups[g.name] = {"lo": lo, "hi": hi, "master": _for_file(g.master_store.read(a, b)), "sliced": sliced,
                          "whole": whole}
    extra = {}
    if rank == 0:
        trainable = {id(p) for g in part.groups for p in g.params}
        extra = {n: t.detach().cpu().clone() for n, t in engine.module.named_parameters() if id(t) not in trainable}
        extra.update({n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()})
    return {
        "rank": rank, "groups": groups, "module_extra": extra, "client_state": client_state or {},
        "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "global_samples": engine.global_samples, "skipped_steps": engine.skipped_steps},
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "optimizer_hparams": [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups],
        "rng": _rng_state(),
    }


def _group_entries(engine: Engine) -> list[dict[str, Any]]:
    """Each flat group's parameters and which rank file holds which range. Experts' groups differ between
    expert ranks (their names carry ``@epE``): every rank's are gathered, so one metadata lists them all."""
    entries = [{"name": g.name, "numel": g.numel,
                "params": [[n, list(s), o] for n, s, o in zip(g.names, g.shapes, g.offsets)],
                "ranges": [[g.file_ranks[r], *_nominal_range(g, r)] for r in range(g.dp.size)]}
               for g in engine._partition.groups]
    if not any(g.expert for g in engine._partition.groups):
        return entries
    merged: dict[str, dict[str, Any]] = {}
    for rank_entries in engine.dp.all_gather_objects(entries):
        for entry in rank_entries:
            merged.setdefault(entry["name"], entry)
    return list(merged.values())


def _metadata(engine: Engine, tag: str, digests: list[str]) -> dict[str, Any]:
    part = engine._partition
    groups = _group_entries(engine)
    canonical = {id(p): n for n, p in engine.module.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in engine.module.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != n}  # tied weights: every name the plain state_dict uses
    return {"format": io.FORMAT_VERSION, "tag": tag, "world_size": engine.dp.size, "stage": part.stage,
            "aliases": aliases,
            "compute_dtype": str(part.groups[0].compute_dtype) if part.groups else None,
            "global_steps": engine.global_steps, "groups": groups,
            "files": {str(r): d for r, d in enumerate(digests)}, "topology": _topology(engine),
            "config": engine.config.model_dump(mode="json")}


def _model_part(engine: Engine) -> str:
    """The sub-directory of this rank's slice of the model: "" without tensor or pipeline parallelism,
    else ``tpTT_ppPP`` (each holds a whole checkpoint of its slice over its data group)."""
    par = engine.parallel
    if par is None or par.model.size == 1:
        return ""
    return f"tp{par.coordinates.tensor:02d}_pp{par.coordinates.pipeline:02d}"


def _world(engine: Engine) -> Any:
    """Every rank of the job (the data group when there is no model parallelism)."""
    par = engine.parallel
    if par is None or par.model.size == 1:
        return engine.dp
    return DataParallelGroup(None)


def _global_rank(engine: Engine) -> int:
    """The rank a message names: the process's in the whole job (the data rank is shared by model slices)."""
    return engine.parallel.global_rank if engine.parallel is not None else engine.dp.rank


def _topology(engine: Engine) -> dict[str, int]:
    par = engine.parallel
    return (par.topology if par is not None else Topology(engine.dp.size)).to_dict()


def save_checkpoint(engine: Engine, save_dir: str, tag: str | None = None,
                    client_state: dict[str, Any] | None = None) -> str:
    """Every rank calls this. Returns the final directory ``save_dir/tag``.

    With tensor or pipeline parallelism each slice of the model is a checkpoint of its own in
    ``tag/tpTT_ppPP/`` (its data group's files and metadata), and ``tag/metadata.json`` lists the
    topology and the slices; the whole tag still appears at once, after every rank has written."""
    dp, world = engine.dp, _world(engine)
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty name without '{os.sep}' that does not start "
                         f"with '.'")
    engine._partition.wait_all()
    tmp_dir = None
    if world.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=save_dir)
    tmp_dir = world.broadcast_object(tmp_dir)
    part = _model_part(engine)
    part_dir = os.path.join(tmp_dir, part) if part else tmp_dir
    os.makedirs(part_dir, exist_ok=True)
    digest = io.save_rank_state(part_dir, dp.rank, rank_state(engine, client_state))
    io.fault_point(f"after_rank_file_{dp.rank}")
    digests = dp.all_gather_objects(digest)
    metadata = _metadata(engine, tag, digests)
    final_dir = os.path.join(save_dir, tag)
    if part:
        if dp.rank == 0:
            io.write_metadata(part_dir, metadata)
        parts = world.all_gather_objects(part)
        metadata = {"format": io.FORMAT_VERSION, "tag": tag, "topology": metadata["topology"],
                    "global_steps": engine.global_steps, "parts": sorted(set(parts))}
    if world.rank == 0:
        io.commit(tmp_dir, final_dir, metadata)
        io.write_latest(save_dir, tag)
    world.barrier()
    return final_dir


def _open_part(engine: Engine, path: str, meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The directory and metadata of this rank's model slice; refuses another tensor, pipeline or expert size."""
    saved = {"tensor": 1, "pipeline": 1, "expert": 1, **meta.get("topology", {})}
    ours = _topology(engine)
    sizes = ("tensor", "pipeline", "expert")
    if any(saved[k] != ours[k] for k in sizes):
        raise ValueError(f"checkpoint {path} was saved with " + " x ".join(f"{k} {saved[k]}" for k in sizes)
                         + f"; this run (rank {_global_rank(engine)}) has "
                         + " x ".join(f"{k} {ours[k]}" for k in sizes)
                         + ": loading across tensor, pipeline or expert sizes is not supported (the data-parallel "
                         "size and ZeRO stage may differ)")
    part = _model_part(engine)
    if not part:
        return path, meta
    part_path = os.path.join(path, part)
    if part not in meta.get("parts", []):
        raise ValueError(f"checkpoint {path} has no slice {part!r} (rank {_global_rank(engine)}); it lists "
                         f"{meta.get('parts')}")
    return part_path, io.read_metadata(part_path)


def _check_layout(engine: Engine, meta: dict[str, Any], path: str) -> None:
    """Same parameter names and shapes; otherwise an error listing the differences. (How they are
    grouped may differ: loading matches parameters by name.)"""
    ours = {n: tuple(s) for g in engine._partition.groups for n, s in zip(g.names, g.shapes)}
    suffixes = {n[n.index("@ep"):] for n in ours if "@ep" in n}  # this rank's expert rank; others' are not ours
    saved = {p[0]: tuple(p[1]) for g in meta["groups"] for p in g["params"]
             if "@ep" not in p[0] or p[0][p[0].index("@ep"):] in suffixes}
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    shapes = sorted(f"{n}: checkpoint {saved[n]} vs model {ours[n]}" for n in set(ours) & set(saved)
                    if saved[n] != ours[n])
    if missing or unexpected or shapes:
        raise ValueError(f"checkpoint {path} does not fit this model (rank {_global_rank(engine)}): missing parameters "
                         f"{missing}, unexpected parameters {unexpected}, shape mismatches {shapes}")


class _Files:
    """Rank files of one checkpoint, read on demand and kept (a rank reads its own range's files,
    about one at the same world size, two or three after resharding, plus rank 0's), checksums
    verified on first read."""

    def __init__(self, path: str, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self._states: dict[int, dict[str, Any]] = {}

    def get(self, rank: int) -> dict[str, Any]:
        if rank not in self._states:
            digest = self.meta["files"].get(str(rank))
            if digest is None:
                raise ValueError(f"{os.path.join(self.path, io.METADATA)} lists no file for rank {rank}")
            self._states[rank] = io.load_rank_state(self.path, rank, digest)
        return self._states[rank]


def _load_group(engine: Engine, g: FlatParamGroup, sources: dict[str, tuple[dict[str, Any], int]],
                files: _Files, load_optim: bool) -> None:
    """Fill this rank's owned range of ``g``'s master (and optimizer states) parameter by
    parameter from whichever saved ranges hold it, so the saved grouping may differ from ours."""
    lo, hi = g.owned_start, min(g.owned_start + g.owned_numel, g.numel)
    pieces = []  # (saved group, saved rank, its range start, piece start, piece end, position in owned buffer)
    for name, off, n in zip(g.names, g.offsets, g.numels):
        ps, pe = max(off, lo), min(off + n, hi)
        if ps >= pe:
            continue
        entry, saved_off = sources[name]
        ss, se = saved_off + ps - off, saved_off + pe - off
        for rank, a, b in entry["ranges"]:
            s, e = max(a, ss), min(b, se)
            if s < e:
                pieces.append((entry["name"], rank, a, s, e, ps - g.owned_start + s - ss))
    opt_state: dict[str, Any] = {}
    if load_optim:  # the state's keys and scalars come from any file: padding-only ranks need them too
        name0, rank0 = (pieces[0][0], pieces[0][1]) if pieces else (sources[g.names[0]][0]["name"],
                                                                    sources[g.names[0]][0]["ranges"][0][0])
        first = files.get(rank0)["groups"][name0]
        for key, value in first["sliced"].items():
            opt_state[key] = engine.ledger.zeros(g.owned_numel, value.dtype, Category.OPTIM_STATE, g.device)
        for key, value in first["whole"].items():
            opt_state[key] = value.clone() if isinstance(value, torch.Tensor) else value
    with torch.no_grad():
        for group_name, rank, a, s, e, at in pieces:
            saved = files.get(rank)["groups"][group_name]
            g.master_store.write(at, saved["master"][s - a:e - a])
            for key, value in saved["sliced"].items() if load_optim else ():
                opt_state[key][at:at + e - s].copy_(value[s - a:e - a])
    if opt_state:
        engine._step.load_state(g, opt_state)


def load_checkpoint(engine: Engine, load_dir: str, tag: str | None = None, *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False) -> tuple[str, dict[str, Any]]:
    """Every rank calls this; returns ``(path, client_state)``."""
    tag = io.resolve_tag(load_dir, tag)
    top = os.path.join(load_dir, tag)
    path, meta = _open_part(engine, top, io.read_metadata(top))
    _check_layout(engine, meta, path)
    engine._partition.wait_all()
    files = _Files(path, meta)
    sources = {name: (entry, offset) for entry in meta["groups"] for name, _, offset in entry["params"]}
    load_optim = load_optimizer_states and not load_module_only
    for g in engine._partition.groups:
        _load_group(engine, g, sources, files, load_optim)
    own = files.get(min(engine.dp.rank, meta["world_size"] - 1))
    extra = files.get(0)["module_extra"]
    with torch.no_grad():
        targets = dict(engine.module.named_parameters())
        targets.update(dict(engine.module.named_buffers()))
        for name, value in extra.items():
            if name in targets:
                targets[name].copy_(value)
    engine._partition.params_from_masters()
    if not load_module_only:
        counters = own["counters"]
        engine.global_steps, engine.micro_steps = counters["global_steps"], counters["micro_steps"]
        engine.global_samples, engine.skipped_steps = counters["global_samples"], counters["skipped_steps"]
        if own["loss_scaler"]:
            engine.loss_scaler.load_state_dict(own["loss_scaler"])
        if load_optim and len(own["optimizer_hparams"]) == len(engine.optimizer.param_groups):
            for pg, hp in zip(engine.optimizer.param_groups, own["optimizer_hparams"]):
                pg.update({k: v for k, v in hp.items() if k in pg and k not in _KERNEL_SWITCHES})
        elif load_optim:
            logger.warning("checkpoint has %d optimizer param groups, this engine %d: keeping this engine's "
                           "hyper-parameters (states were matched by parameter name)",
                           len(own["optimizer_hparams"]), len(engine.optimizer.param_groups))
        if load_lr_scheduler_states and engine.lr_scheduler is not None and own["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(own["lr_scheduler"])
        if meta["world_size"] == engine.dp.size and own.get("rng"):
            _set_rng_state(own["rng"])
    engine.dp.barrier()
    return top, own["client_state"]
