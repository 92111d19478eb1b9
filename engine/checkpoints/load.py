"""Loading a sharded checkpoint into an engine: all or nothing, on every rank.

Three phases. **Read**: each rank resolves the tag, reads the metadata, checks the layout, reads and
verifies (SHA-256, weights-only unpickling: ``safe_load.py``) every file that holds part of its new
owned range, checks that every range, state key and buffer shape it is about to copy is there, and
allocates the optimizer-state buffers it will fill. Nothing of the engine changes. **Agree**: the
ranks exchange their outcome (one small all-gather over the whole job); if any rank failed, every
rank raises, naming the failing rank and its file, and every engine stays bitwise as it was.
**Apply**: masters, optimizer states, buffers and frozen parameters, embedding-table shards
(``table_shards.py``: resharded from the saved rectangles that overlap each rank's), counters, loss scaler,
hyper-parameters, schedule and RNG are written from what was read; the outcome is exchanged once
more, so a rank that fails here (an offload file that cannot be written) is named on every rank.

Memory while loading: the files that overlap this rank's range (a rank reads its own range's files,
about one at the same world size, two or three after resharding, plus rank 0's for buffers), kept
until the load ends, and the new optimizer-state buffers beside the old ones until they replace them.
A DeepSpeed checkpoint (a tag holding DeepSpeed's ZeRO-1/2/3 files: what a DeepSpeed run, or the Trainer
under DeepSpeed, saved) is loaded the same way after the first rank imports it (``deepspeed_import.py``) into
a hidden directory beside it, ``.zeroplus-import-TAG``, removed once every rank has loaded: resuming a
DeepSpeed run under zeroplus is changing the launch line. Memory: the importer's, on the first rank only
(one optimizer file read at a time; the whole model's fp32 masters and states written out).
See note: read agree apply (docs/design-notes.md).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable

import torch

from zeroplus.ledger import Category
from zeroplus.optim.stored_states import state_dtype
from zeroplus.zero.flat_group import FlatParamGroup

from . import files as io
from .dcp_load import DcpCheckpoint, DcpFiles, dcp_dir
from .dcp_save import param_group_of
from .deepspeed_import import convert_deepspeed, deepspeed_tag
from .save import _global_rank, _model_part, _set_rng_state, _topology, _world
from .table_shards import plan_tables, shard_names

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses

logger = logging.getLogger("zeroplus.checkpoint")

# Param-group keys that choose torch's implementation, not the math: this engine keeps its own.
_KERNEL_SWITCHES = frozenset({"fused", "foreach", "capturable", "differentiable"})


class CheckpointLoadError(ValueError):
    """Another rank could not read its part of the checkpoint: nothing was loaded on any rank."""


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
    span = (bool(saved.get("experts_span_tensor")), bool(ours.get("experts_span_tensor")))
    if ours["expert"] > 1 and span[0] != span[1]:
        mode = {True: "drawn from data x tensor (experts_span_tensor)", False: "drawn from data ranks"}
        raise ValueError(f"checkpoint {path} was saved with expert groups {mode[span[0]]}; this run (rank "
                         f"{_global_rank(engine)}) has them {mode[span[1]]}: the same expert rank holds other "
                         f"experts, so loading is refused")
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
    ours = {n: tuple(s) for g in engine.partition.groups for n, s in zip(g.names, g.shapes)}
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
    """Rank files of one checkpoint, read on demand and kept, checksums verified on first read."""

    def __init__(self, path: str, meta: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self._states: dict[int, dict[str, Any]] = {}

    def name(self, rank: int) -> str:
        return os.path.join(self.path, io.rank_file(rank))

    def get(self, rank: int) -> dict[str, Any]:
        if rank not in self._states:
            digest = self.meta["files"].get(str(rank))
            if digest is None:
                raise ValueError(f"{os.path.join(self.path, io.METADATA)} lists no file for rank {rank}")
            self._states[rank] = io.load_rank_state(self.path, rank, digest)
        return self._states[rank]


@dataclasses.dataclass
class _Piece:
    """A run of elements copied from a saved range into this rank's owned range."""

    saved: dict[str, Any]  # the saved group's entry in the rank file (master, sliced states)
    src: int               # first element within the saved range
    numel: int
    at: int                # position in this rank's owned buffer


@dataclasses.dataclass
class _GroupLoad:
    group: FlatParamGroup
    pieces: list[_Piece]
    opt_state: dict[str, Any] | None  # the new optimizer state, sliced tensors allocated, or None


@dataclasses.dataclass
class _Plan:
    """Everything a rank will write, read and checked before anything is written."""

    top: str
    groups: list[_GroupLoad]
    extra: dict[str, torch.Tensor]  # buffers and frozen parameters (rank 0's file)
    own: dict[str, Any]             # counters, scaler, schedule, hyper-parameters, RNG, client state
    saved_world: int                # the data-parallel size that saved it (0: unknown, a DCP checkpoint)
    tables: list[Callable[[], None]] = dataclasses.field(default_factory=list)  # table_shards.py's copies


def _plan_group(engine: Engine, g: FlatParamGroup, sources: dict[str, tuple[dict[str, Any], int]],
                files: _Files | DcpFiles, load_optim: bool) -> _GroupLoad:
    """Which saved ranges fill this rank's owned range of ``g``, parameter by parameter (so the saved
    grouping may differ from ours), each checked against the file that holds it."""
    lo, hi = g.owned_start, min(g.owned_start + g.owned_numel, g.numel)
    pieces: list[_Piece] = []
    keys: set[str] | None = None
    for name, off, n in zip(g.names, g.offsets, g.numels):
        ps, pe = max(off, lo), min(off + n, hi)
        if ps >= pe:
            continue
        entry, saved_off = sources[name]
        ss, se = saved_off + ps - off, saved_off + pe - off
        for rank, a, b in entry["ranges"]:
            s, e = max(a, ss), min(b, se)
            if s >= e:
                continue
            saved = files.get(rank)["groups"].get(entry["name"])
            where = f"{files.name(rank)}, group {entry['name']!r}"
            if saved is None or saved.get("lo") != a or saved["master"].numel() < e - a:
                raise ValueError(f"checkpoint file {where} does not hold the range [{a}, {b}) that "
                                 f"{io.METADATA} says it does")
            if load_optim:
                keys = set(saved["sliced"]) if keys is None else keys
                short = [k for k, v in saved["sliced"].items() if v.numel() < e - a]
                if set(saved["sliced"]) != keys or short:
                    raise ValueError(f"checkpoint file {where}: optimizer states {sorted(saved['sliced'])} do not "
                                     f"cover [{a}, {b}) like the other files' {sorted(keys)}")
            pieces.append(_Piece(saved, s - a, e - s, ps - g.owned_start + s - ss))
    opt_state = None
    if load_optim:  # the state's keys and scalars come from any file: padding-only ranks need them too
        entry, _ = sources[g.names[0]]
        first = pieces[0].saved if pieces else files.get(entry["ranges"][0][0])["groups"][entry["name"]]
        opt_state = {key: engine.ledger.zeros(g.owned_numel, state_dtype(engine.optimizer, key, value.dtype),
                                              Category.OPTIM_STATE, g.device)  # (saved in another dtype: converted)
                     for key, value in first["sliced"].items()}
        opt_state.update({key: value.clone() if isinstance(value, torch.Tensor) else value
                          for key, value in first["whole"].items()})
    return _GroupLoad(g, pieces, opt_state)


def _check_extra(engine: Engine, extra: dict[str, torch.Tensor], where: str, strict: bool) -> None:
    """Shapes of the saved buffers and frozen parameters; ``strict``: every frozen parameter of the model
    must be in the checkpoint (one saved with ``exclude_frozen_parameters=True`` has none of them)."""
    shapes: dict[str, tuple[int, ...]] = {n: tuple(t.shape) for n, t in engine.module.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in engine.module.named_buffers()})
    shapes.update({n: tuple(s) for g in engine.partition.frozen for n, s in zip(g.names, g.shapes)})  # (released)
    wrong = [f"{n}: checkpoint {tuple(v.shape)} vs model {shapes[n]}" for n, v in extra.items()
             if n in shapes and shapes[n] != tuple(v.shape)]
    if wrong:
        raise ValueError(f"checkpoint file {where}: buffers or frozen parameters of another shape: {wrong}")
    trainable = {id(p) for g in engine.partition.groups for p in g.params}
    missing = [n for n, p in engine.module.named_parameters() if id(p) not in trainable and n not in extra]
    if strict and missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"checkpoint file {where} lacks {len(missing)} frozen parameters of this model ({shown}; "
                         f"rank {_global_rank(engine)}): it was saved with exclude_frozen_parameters=True (an "
                         f"adapter's checkpoint). Load it with strict=False (DeepSpeed API: load_module_strict=False), "
                         f"which keeps the model's own frozen parameters")


def _read(engine: Engine, load_dir: str, tag: str | None, load_optim: bool, strict: bool) -> _Plan:
    tag = io.resolve_tag(load_dir, tag)
    top = os.path.join(load_dir, tag)
    path, meta = _open_part(engine, top, io.read_metadata(top))
    _check_layout(engine, meta, path)
    files = _Files(path, meta)
    sources = {name: (entry, offset) for entry in meta["groups"] for name, _, offset in entry["params"]}
    groups = [_plan_group(engine, g, sources, files, load_optim) for g in engine.partition.groups]
    own_rank = min(engine.dp.rank, meta["world_size"] - 1)
    own = files.get(own_rank)
    absent = [k for k in ("counters", "loss_scaler", "lr_scheduler", "optimizer_hparams", "client_state")
              if k not in own] + [f"counters.{k}" for k in engine.counters() if k not in own.get("counters", {})]
    if absent:
        raise ValueError(f"checkpoint file {files.name(own_rank)} lacks {absent}")
    extra = files.get(0)["module_extra"]
    _check_extra(engine, extra, files.name(0), strict)
    tables = plan_tables(engine, meta, files.get, files.name, load_optim)
    return _Plan(top, groups, extra, own, meta["world_size"], tables)


def _overlapping(engine: Engine) -> list[str]:
    """The trained parameters that overlap this rank's owned range of their group (a group with none: its first,
    whose states' keys and scalars the rank needs all the same)."""
    names: list[str] = []
    for g in engine.partition.groups:
        lo, hi = g.owned_start, g.owned_start + g.owned_numel
        mine = [n for n, off, k in zip(g.names, g.offsets, g.numels) if off < hi and off + k > lo]
        names += mine or g.names[:1]
    return names


def _read_dcp(engine: Engine, path: str, load_optim: bool, load_scheduler: bool, strict: bool) -> _Plan:
    """A DCP checkpoint (``dcp_load.py``) planned like zeroplus's own files."""
    if shard_names(engine):
        raise ValueError(f"DCP checkpoint {path} cannot be loaded into a model with sharded embedding tables (rank "
                         f"{_global_rank(engine)}): DCP's layout has no table shards; load a zeroplus checkpoint")
    topology = _topology(engine)
    if any(topology.get(k, 1) > 1 for k in ("tensor", "pipeline", "expert")):
        raise ValueError(f"DCP checkpoint {path} cannot be loaded by this run (rank {_global_rank(engine)}): its "
                         f"model is split ({topology}); a DCP checkpoint loads into data and ZeRO parallelism only")
    trained = {n: tuple(s) for g in engine.partition.groups for n, s in zip(g.names, g.shapes)}
    ckpt = DcpCheckpoint(path, trained, load_optim)
    meta = ckpt.layout(trained)
    _check_layout(engine, meta, path)
    files = DcpFiles(ckpt)
    files.preload(_overlapping(engine))
    sources = {name: (entry, offset) for entry in meta["groups"] for name, _, offset in entry["params"]}
    groups = [_plan_group(engine, g, sources, files, load_optim) for g in engine.partition.groups]
    steps = files.check_states() if load_optim else set()
    frozen = {n for g in engine.partition.frozen for n in g.names}
    trainable = {id(p) for g in engine.partition.groups for p in g.params}
    wanted = frozen | {n for n, p in engine.module.named_parameters() if id(p) not in trainable}
    wanted |= {n for n, _ in engine.module.named_buffers()}
    extra = ckpt.read_model([n for n in sorted(wanted) if n in ckpt.sizes])
    _check_extra(engine, extra, path, strict)
    counters = engine.counters()
    if steps:
        done = int(steps.pop())
        counters = {"global_steps": done, "micro_steps": done * engine.gradient_accumulation_steps(),
                    "global_samples": done * engine.train_batch_size(), "skipped_steps": 0}
        if load_scheduler and engine.lr_scheduler is not None and engine.dp.rank == 0:
            logger.warning("DCP checkpoint %s holds no learning-rate schedule zeroplus can read: the engine keeps "
                           "its own schedule's position while the step moves to %d", path, done)
    by_index: dict[int, list[str]] = {}
    for g in engine.partition.groups:
        by_index.setdefault(param_group_of(g.name), []).extend(g.names)
    hparams = ckpt.hparams([by_index.get(i, []) for i in range(len(engine.optimizer.param_groups))])
    own = {"counters": counters, "loss_scaler": {}, "lr_scheduler": None, "optimizer_hparams": hparams,
           "client_state": {}, "rng": None}
    return _Plan(path, groups, extra, own, 0)


def _small_state(engine: Engine) -> dict[str, Any]:
    """What ``_apply`` changes besides tensors, to put back if applying fails."""
    return {"counters": engine.counters(),
            "scaler": copy.deepcopy(engine.loss_scaler.state_dict()),
            "hparams": [{k: v for k, v in pg.items() if k != "params"} for pg in engine.optimizer.param_groups],
            "scheduler": copy.deepcopy(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None}


def _restore_small_state(engine: Engine, state: dict[str, Any]) -> None:
    engine.set_counters(state["counters"])
    engine.loss_scaler.load_state_dict(state["scaler"])
    for pg, hp in zip(engine.optimizer.param_groups, state["hparams"]):
        pg.update(hp)
    if state["scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])


def _apply_small(engine: Engine, own: dict[str, Any], load_optim: bool, load_scheduler: bool,
                 same_world: bool) -> None:
    engine.set_counters({k: own["counters"][k] for k in engine.counters()})
    if own["loss_scaler"]:
        engine.loss_scaler.load_state_dict(own["loss_scaler"])
    if load_optim and len(own["optimizer_hparams"]) == len(engine.optimizer.param_groups):
        for pg, hp in zip(engine.optimizer.param_groups, own["optimizer_hparams"]):
            pg.update({k: v for k, v in hp.items() if k in pg and k not in _KERNEL_SWITCHES})
    elif load_optim:
        logger.warning("checkpoint has %d optimizer param groups, this engine %d: keeping this engine's "
                       "hyper-parameters (states were matched by parameter name)",
                       len(own["optimizer_hparams"]), len(engine.optimizer.param_groups))
    if load_scheduler and engine.lr_scheduler is not None and own["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(own["lr_scheduler"])
    if same_world and own.get("rng"):
        _set_rng_state(own["rng"])


def _apply_tensors(engine: Engine, plan: _Plan) -> None:
    with torch.no_grad():
        for load in plan.groups:
            g = load.group
            for piece in load.pieces:
                g.master_store.write(piece.at, piece.saved["master"][piece.src:piece.src + piece.numel])
                states = load.opt_state
                if states is not None:
                    for key, value in piece.saved["sliced"].items():
                        states[key][piece.at:piece.at + piece.numel].copy_(value[piece.src:piece.src + piece.numel])
            if load.opt_state:
                engine.sharded_step.load_state(g, load.opt_state)
        frozen = {n: (g, i) for g in engine.partition.frozen for i, n in enumerate(g.names)}
        targets: dict[str, torch.Tensor] = dict(engine.module.named_parameters())
        targets.update(dict(engine.module.named_buffers()))
        for name, value in plan.extra.items():
            if name in frozen:  # stage 3: into this rank's shard (params_from_masters re-gathers below)
                group, index = frozen[name]
                group.write_param(index, value.reshape(-1))
            elif name in targets:
                targets[name].copy_(value)
        for write in plan.tables:
            write()
    engine.partition.params_from_masters()


def _agree(world: Any, rank: int, error: BaseException | None, doing: str, top: str) -> None:
    """Raise on every rank if any rank failed: its own error where it failed, else a
    ``CheckpointLoadError`` naming the ranks that failed and why."""
    outcomes = world.all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not failed:
        return
    if error is not None:
        if doing == "reading":
            error = _with_note(error, "nothing was loaded on any rank")
        raise error
    raise CheckpointLoadError(f"checkpoint {top} was not loaded on rank {rank}: " + "; ".join(
        f"rank {r} failed {doing}: {o}" for r, o in failed) + (
        ". Nothing was loaded on any rank" if doing == "reading" else ""))


def _with_note(error: BaseException, note: str) -> BaseException:
    """The same kind of error, its message followed by ``note``."""
    try:
        noted = type(error)(f"{error} ({note})")
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return error
    return noted.with_traceback(error.__traceback__)


def load_checkpoint(engine: Engine, load_dir: str, tag: str | None = None, *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, strict: bool = True) -> tuple[str, dict[str, Any]]:
    """Every rank calls this; returns ``(path, client_state)``. On any rank's failure every rank raises
    and no engine has changed (see the module docstring). ``strict`` False: frozen parameters the
    checkpoint lacks keep their values (trained parameters must all be there either way). A DeepSpeed
    checkpoint is imported first (see the module docstring); the path returned is its own."""
    world, rank = _world(engine), _global_rank(engine)
    ds_tag = deepspeed_tag(load_dir, tag)
    if ds_tag is not None:
        imported = os.path.join(load_dir, f".zeroplus-import-{ds_tag}")
        error = None
        if rank == 0:
            logger.info("%s is a DeepSpeed checkpoint: importing it (zeroplus convert --from-deepspeed)",
                        os.path.join(load_dir, ds_tag))
            try:
                shutil.rmtree(imported, ignore_errors=True)
                convert_deepspeed(load_dir, imported, ds_tag)
            except Exception as err:  # noqa: BLE001 - every rank must hear of it
                error = _with_note(err, f"importing DeepSpeed checkpoint {os.path.join(load_dir, ds_tag)} into "
                                        f"{imported}; zeroplus convert --from-deepspeed DIR OUT writes it elsewhere")
        try:
            _agree(world, rank, error, "importing", os.path.join(load_dir, ds_tag))
            _, client_state = load_checkpoint(engine, imported, ds_tag, load_optimizer_states=load_optimizer_states,
                                              load_lr_scheduler_states=load_lr_scheduler_states,
                                              load_module_only=load_module_only, strict=strict)
        finally:  # (every rank has read what it needed: the load's last step is an exchange among all ranks)
            if rank == 0:
                shutil.rmtree(imported, ignore_errors=True)
        return os.path.join(load_dir, ds_tag), client_state
    load_optim = load_optimizer_states and not load_module_only
    engine.partition.wait_all()
    plan, error = None, None
    try:
        dcp_path = dcp_dir(load_dir, tag)
        plan = _read(engine, load_dir, tag, load_optim, strict) if dcp_path is None else \
            _read_dcp(engine, dcp_path, load_optim, load_lr_scheduler_states and not load_module_only, strict)
    except Exception as err:  # noqa: BLE001 - every rank must hear of it before anyone writes
        error = err
    _agree(world, rank, error, "reading", os.path.join(load_dir, tag or io.LATEST))
    assert plan is not None
    before = _small_state(engine)
    try:
        if not load_module_only:
            _apply_small(engine, plan.own, load_optim, load_lr_scheduler_states,
                         same_world=engine.dp.size == plan.saved_world)
        _apply_tensors(engine, plan)
    except Exception as err:  # noqa: BLE001
        _restore_small_state(engine, before)
        error = RuntimeError(f"rank {rank} failed while writing checkpoint {plan.top} into the engine "
                             f"(its parameters may be partly loaded): {type(err).__name__}: {err}")
    _agree(world, rank, error, "writing", plan.top)
    return plan.top, plan.own["client_state"]
