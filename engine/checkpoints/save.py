"""Sharded, elastic checkpoints of an engine: what each rank saves (loading: ``load.py``).

Each rank saves, per flat group, its *nominal* range ``[r * S, (r + 1) * S)`` clipped to the
group's unpadded length: the fp32 master values and every optimizer-state tensor of that range
(at stage 0, where a rank holds everything, it still saves only its nominal range, so the files
never repeat each other). Plus: step counters, loss scaler, schedule, optimizer hyper-parameters,
RNG states and the client state; rank 0 also saves buffers and frozen parameters; each rank its
embedding-table shards (``table_shards.py``). Low-precision
parameters are not saved: they are the masters rounded. ``metadata.json`` records every group's
parameters (name, shape, offset), which rank saved which range, and each file's SHA-256.

Loading needs only the metadata to know which files hold a rank's new owned range, and matches
parameters by name, so a checkpoint loads at any data-parallel size, ZeRO stage, unit choice or
param-group split (elastic by construction). Memory while
saving: nothing more where a rank's nominal range is a whole buffer it holds (stages 1-3; the file
streams from the tensors themselves), a copy of the nominal range where it is a slice of a larger
buffer (stage 0; fp32 parameters at stages 1-2, whose master is a range of the full flat buffer)
or the master is stored split (shared bf16/fp32 masters merge into fp32).
See note: streamed save (docs/design-notes.md).
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zeroplus.comm import DataParallelGroup
from zeroplus.offload.optimizer_states import per_element
from zeroplus.parallel.plan_slices import cut_of, slicing
from zeroplus.parallel.topology import Topology
from zeroplus.zero.flat_group import FlatParamGroup
from zeroplus.zero.frozen_values import read_frozen

from . import files as io
from .async_save import PendingSave, allocate
from .dcp_save import write_dcp
from .hf_export import hf_config, tied_aliases
from .safe_load import check_loadable, numpy_rng_from_file, numpy_rng_to_file
from .table_shards import shard_names, table_layout, table_state

logger = logging.getLogger("zeroplus.checkpoint")

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses


def _nominal_range(g: FlatParamGroup, rank: int) -> tuple[int, int]:
    lo = min(rank * g.shard_numel, g.numel)
    return lo, min(lo + g.shard_numel, g.numel)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": numpy_rng_to_file(np.random.get_state())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(numpy_rng_from_file(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _for_file(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its storage is (nearly) all its own, else a copy: torch.save writes a view's whole
    storage. "Nearly": up to 1/16 more, which covers the alignment padding at the end of the last rank's
    shard (loading reads only the saved range), while a stage-0 rank's half of a flat buffer is copied."""
    own = t.numel() * t.element_size()
    return t if t.untyped_storage().nbytes() - own <= own // 16 else t.clone()


def _start_async(engine: Engine, world: Any, client_state: dict[str, Any] | None, exclude_frozen_parameters: bool,
                 save_dir: str, tmp_dir: str, part: str, final_dir: str, tag: str, save_latest: bool,
                 keep_k: int | None) -> str:
    """An asynchronous save: this rank's state staged in host memory, the file and the commit left to the
    background (``async_save.py``); refused for a model split by tensor or pipeline parallelism."""
    if part:
        if world.rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ValueError(f"save_checkpoint(async_save=True) on rank {_global_rank(engine)}: asynchronous saves "
                         f"of a model split by tensor or pipeline parallelism are not built; save synchronously")
    state, pairs, copies = allocate(rank_state(engine, client_state, exclude_frozen_parameters),
                                    engine.accelerator, engine.ledger)
    pending = PendingSave(final_dir, engine.async_saves.group(world), _global_rank(engine))
    engine.async_saves.start(pending, {
        "tmp_dir": tmp_dir, "dp_rank": engine.dp.rank, "state": state, "pairs": pairs, "copies": copies,
        "ledger": engine.ledger,
        "metadata": _metadata(engine, tag, [], exclude_frozen_parameters), "save_latest": save_latest,
        "save_dir": save_dir, "tag": tag, "keep_k": keep_k})
    return final_dir


def _write_rank_file(engine: Engine, world: Any, client_state: dict[str, Any] | None,
                     exclude_frozen_parameters: bool, tmp_dir: str, part: str, final_dir: str,
                     tag: str) -> dict[str, Any]:
    """This rank's file in the temporary directory (its model part's, with tensor or pipeline parallelism), every
    rank agreeing it was written; the metadata to commit (a split model's part metadata written by its data rank 0,
    the tag's listing the parts)."""
    dp = engine.dp
    part_dir = os.path.join(tmp_dir, part) if part else tmp_dir
    digest, error = None, None
    try:
        os.makedirs(part_dir, exist_ok=True)
        digest = io.save_rank_state(part_dir, dp.rank, rank_state(engine, client_state, exclude_frozen_parameters),
                                    _global_rank(engine))
    except OSError as err:
        error = err
    io.fault_point(f"after_rank_file_{dp.rank}")
    _agree_written(engine, world, tmp_dir, final_dir, error)
    digests = dp.all_gather_objects(digest)
    metadata = _metadata(engine, tag, digests, exclude_frozen_parameters)
    if part:
        if dp.rank == 0:
            io.write_metadata(part_dir, metadata)
        parts = world.all_gather_objects(part)
        metadata = {"format": io.FORMAT_VERSION, "tag": tag, "topology": metadata["topology"],
                    "global_steps": engine.global_steps, "parts": sorted(set(parts))}
    return metadata


def _commit(tmp_dir: str, final_dir: str, metadata: dict[str, Any] | None, save_dir: str, tag: str,
            save_latest: bool, keep_k: int | None) -> None:
    """Rank 0: the temporary directory becomes the checkpoint at once, ``latest`` follows, older ones are pruned."""
    io.commit(tmp_dir, final_dir, metadata)
    if save_latest:
        io.write_latest(save_dir, tag)
    if keep_k is not None:
        removed = io.keep_latest(save_dir, keep_k, tag)
        if removed:
            logger.info("keep_latest_k %d: removed checkpoints %s from %s", keep_k, removed, save_dir)


def rank_state(engine: Engine, client_state: dict[str, Any] | None,
               exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """What this rank's file holds (the memory estimate runs it on the meta device for the save phase).
    ``exclude_frozen_parameters``: rank 0's ``module_extra`` holds the buffers only, not the parameters
    that no optimizer trains (a PEFT adapter's checkpoint: the base model is loaded from its own files)."""
    part, opt, rank = engine.partition, engine.optimizer, engine.dp.rank
    groups: dict[str, Any] = {}
    for g in part.groups:
        lo, hi = _nominal_range(g, g.dp.rank)
        a, b = lo - g.owned_start, hi - g.owned_start
        sliced, whole = {}, {}
        for key, value in engine.sharded_step.state_of(g).items():
            if per_element(value, g.owned_numel):
                sliced[key] = _for_file(value[a:b])
            else:
                whole[key] = value
        groups[g.name] = {"lo": lo, "hi": hi, "master": _for_file(g.master_store.read(a, b)), "sliced": sliced,
                          "whole": whole}
    extra: dict[str, torch.Tensor] = {}
    copy = engine.accelerator.host_copy
    if not exclude_frozen_parameters:  # stage 3's frozen groups whole on rank 0 (every rank gathers them)
        extra = read_frozen(part.frozen, copy if rank == 0 else None)
    if rank == 0:
        flat = {id(p) for g in part.groups + part.frozen for p in g.params}
        if not exclude_frozen_parameters:
            extra.update({n: copy(t) for n, t in engine.module.named_parameters() if id(t) not in flat})
        shards = shard_names(engine)  # embedding tables' shards: each rank's own, under "tables"
        extra.update({n: copy(b) for n, b in engine.module.named_buffers() if n not in shards})
    return {
        "rank": rank, "groups": groups, "module_extra": extra, "client_state": client_state or {},
        "tables": table_state(engine),
        "counters": engine.counters(),
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
               for g in engine.partition.groups]
    if not any(g.expert for g in engine.partition.groups):
        return entries
    merged: dict[str, dict[str, Any]] = {}
    for rank_entries in engine.dp.all_gather_objects(entries):
        for entry in rank_entries:
            merged.setdefault(entry["name"], entry)
    return list(merged.values())


def _metadata(engine: Engine, tag: str, digests: list[str], exclude_frozen_parameters: bool) -> dict[str, Any]:
    part = engine.partition
    groups = _group_entries(engine)
    aliases = tied_aliases(engine.module)  # tied weights: every name the plain state_dict uses
    return {"format": io.FORMAT_VERSION, "tag": tag, "world_size": engine.dp.size, "stage": part.stage,
            "aliases": aliases,
            "compute_dtype": str(part.groups[0].compute_dtype) if part.groups else None,
            "global_steps": engine.global_steps, "groups": groups, "tables": table_layout(engine),
            "frozen_parameters_excluded": exclude_frozen_parameters,
            "non_persistent_buffers": io.non_persistent_buffers(engine.module),
            "files": {str(r): d for r, d in enumerate(digests)}, "topology": _topology(engine),
            "config": engine.config.model_dump(mode="json"), "hf_config": hf_config(engine.module),
            "cuts": _cuts(engine)}


def _cuts(engine: Engine) -> dict[str, list[Any]] | None:
    """How a Hugging Face model's plans cut each parameter (``[kind, dim, packed]`` by its whole-model name), so a
    split checkpoint can be joined offline (``split_export.py``); {} for a model not split; None for one split by
    zeroplus's own layers or pipeline stages, whose slices whole-model names do not address."""
    try:
        if slicing(engine.module, engine.parallel, "checkpoint") is None:
            return {}
    except ValueError:
        return None
    found = ((n, cut_of(p)) for n, p in engine.module.named_parameters())
    return {n: [c[0], c[1].dim, c[1].packed] for n, c in found if c is not None}


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


def _prepare(save_dir: str, final_dir: str, tag: str) -> tuple[str | None, str | None]:
    """Rank 0: the temporary directory of this save, or why the save is refused."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        io.remove_stale(save_dir)
        io.can_replace(final_dir)
        return tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=save_dir), None
    except (OSError, ValueError) as err:
        return None, str(err)


def _agreed_tag(engine: Engine, world: Any, tag: str) -> str:
    """The tag every rank saves under: the first rank's. Ranks that gave others are told by
    ``checkpoint.tag_validation`` (DeepSpeed's): WARN logs it, FAIL raises on every rank before anything is
    written, IGNORE says nothing."""
    tags = world.all_gather_objects(tag)
    if len(set(tags)) == 1:
        return tag
    mode = engine.config.checkpoint.tag_validation
    differ = "checkpoint tags differ across ranks: " + ", ".join(f"rank {r} {t!r}" for r, t in enumerate(tags))
    if mode == "FAIL":
        raise ValueError(f"{differ} (rank {_global_rank(engine)}; checkpoint.tag_validation is Fail): nothing was "
                         f"saved")
    if mode == "WARN" and world.rank == 0:
        logger.warning("%s; saving under rank 0's (checkpoint.tag_validation Warn)", differ)
    return tags[0]


def _check_format(engine: Engine, fmt: str, background: bool, client_state: dict[str, Any] | None) -> None:
    """Refuse, before anything is written, a format this save cannot write."""
    where = f"save_checkpoint(format={fmt!r}) on rank {_global_rank(engine)}"
    if fmt not in ("zeroplus", "dcp"):
        raise ValueError(f"{where}: the format is 'zeroplus' (default) or 'dcp'")
    if fmt != "dcp":
        return
    why = ("a model split by tensor or pipeline parallelism" if _model_part(engine)
           else "expert-parallel groups" if any(g.expert for g in engine.partition.groups)
           else "sharded embedding tables" if shard_names(engine)
           else "an asynchronous save" if background
           else "a client_state" if client_state else "")
    if why:
        raise ValueError(f"{where}: {why} cannot be saved as a DCP checkpoint (it holds the model, the optimizer "
                         f"states and hyper-parameters in FSDP2's layout); save it in zeroplus's format")


def _agree_written(engine: Engine, world: Any, tmp_dir: str, final_dir: str, error: BaseException | None) -> None:
    """Every rank raises if any rank failed to write its part; the previous checkpoint stays as it was."""
    failures = [o for o in world.all_gather_objects(None if error is None else str(error)) if o is not None]
    if not failures:
        return
    if world.rank == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if error is not None:
        raise error
    raise RuntimeError(f"checkpoint {final_dir} was not saved (rank {_global_rank(engine)}): "
                       + "; ".join(failures) + f"; {io.LATEST} still names the previous checkpoint")


def save_checkpoint(engine: Engine, save_dir: str, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False, keep_latest_k: int | None = None,
                    async_save: bool | None = None, format: str | None = None) -> str:
    """Every rank calls this. Returns the final directory ``save_dir/tag``; ``save_latest``: point
    ``save_dir/latest`` at it; ``exclude_frozen_parameters``: leave out the parameters no optimizer
    trains (loading it back needs ``strict=False``, which keeps the model's own). ``keep_latest_k`` (default:
    ``zeroplus.keep_latest_k`` in the config; None keeps every one): once this one is committed, older
    checkpoints in ``save_dir`` beyond the ``k`` newest are removed (``files.keep_latest``). ``async_save``
    (default: ``zeroplus.async_save``): return once this rank's state is staged in host memory; the file and
    the commit follow in the background (``async_save.py``), and the path returned is where it will appear.
    ``format`` (default: ``zeroplus.checkpoint_format``): "zeroplus", or "dcp" for a torch.distributed.checkpoint
    that FSDP2 and torchtitan load (``dcp_save.py``: model, optimizer states and hyper-parameters; no schedule,
    RNG or client state).

    With tensor or pipeline parallelism each slice of the model is a checkpoint of its own in
    ``tag/tpTT_ppPP/`` (its data group's files and metadata), and ``tag/metadata.json`` lists the
    topology and the slices; the whole tag still appears at once, after every rank has written."""
    world = _world(engine)
    engine.async_saves.wait()  # one save at a time: the one before is committed (or raises) first
    keep_k = engine.config.zeroplus.keep_latest_k if keep_latest_k is None else keep_latest_k
    background = engine.config.zeroplus.async_save if async_save is None else async_save
    fmt = engine.config.zeroplus.checkpoint_format if format is None else format
    _check_format(engine, fmt, background, client_state)
    if keep_k is not None and (isinstance(keep_k, bool) or not isinstance(keep_k, int) or keep_k < 1):
        raise ValueError(f"save_checkpoint(keep_latest_k={keep_k!r}) on rank {_global_rank(engine)}: a positive "
                         f"number of checkpoints to keep, or None to keep every one")
    tag = _agreed_tag(engine, world, tag if tag is not None else f"global_step{engine.global_steps}")
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a non-empty name without '{os.sep}' that does not start "
                         f"with '.'")
    if client_state:
        check_loadable(client_state, what=f"the client_state given to save_checkpoint (rank {_global_rank(engine)})")
    engine.partition.wait_all()
    final_dir = os.path.join(save_dir, tag)
    tmp_dir, refusal = world.broadcast_object(_prepare(save_dir, final_dir, tag) if world.rank == 0 else None)
    if refusal is not None:
        raise ValueError(f"checkpoint {final_dir} not saved (rank {_global_rank(engine)}): {refusal}")
    part = _model_part(engine)
    if background:
        return _start_async(engine, world, client_state, exclude_frozen_parameters, save_dir, tmp_dir, part,
                            final_dir, tag, save_latest, keep_k)
    if fmt == "dcp":
        error = None
        try:
            write_dcp(engine, tmp_dir, rank_state(engine, None, exclude_frozen_parameters), engine.dp.group)
        except Exception as err:  # noqa: BLE001 - DCP raises on every rank when any fails; each rank says so
            error = err
        _agree_written(engine, world, tmp_dir, final_dir, error)
        metadata = None  # DCP's own .metadata, written last, marks the directory whole
    else:
        metadata = _write_rank_file(engine, world, client_state, exclude_frozen_parameters, tmp_dir, part,
                                    final_dir, tag)
    if world.rank == 0:
        _commit(tmp_dir, final_dir, metadata, save_dir, tag, save_latest, keep_k)
    world.barrier()
    return final_dir
