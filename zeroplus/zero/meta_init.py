"""Models built on the meta device (``with torch.device("meta"): model = ...``), given to ``initialize``.

Nothing of the model exists yet; ``materialize_meta`` gives it values at the memory of its shards by
running the initialisation a normal build runs, in the same order, so that the values equal, bit for
bit, the same model built normally under the same ``torch.manual_seed`` (the random stream is where a
normal build would have started it, since a meta build draws nothing):

- a Hugging Face model (it has ``config`` and ``post_init``) is built again from its config under
  ``zeroplus.Init`` (``construction.py``), which replays its construction exactly, draws made in
  ``__init__`` included (GPT-2's ``Conv1D`` draws there), and its ``post_init``; the rebuilt model must
  have the meta model's names, shapes and dtypes (a model changed after construction, e.g. embeddings
  resized, cannot be rebuilt: an error lists the differences), and its tensors take the meta ones'
  places, ties kept; a parameter that holds a rank's slice of the built one (a model split by its plans, AutoTP
  or AutoEP) gets that slice, cut from the built parameter gathered whole, one at a time, and partitioned over
  the ranks that hold the same slice;
- any other model is replayed: each module's ``reset_parameters()`` in module order (what torch's
  layers run in their ``__init__``), then ``init_fn`` over the modules as ``Module.apply`` visits them,
  when given. Every parameter starts partitioned and empty (``init_shards.blank``); an initialisation
  that touches one gets it whole (the gather-on-touch window of ``construction.py``), and it returns to
  its shard, rank 0's values, when the window moves on. A parameter or buffer that nothing wrote is an
  error naming its module; a module with parameters and no ``reset_parameters`` is named in a warning
  (its ``__init__`` may have drawn random numbers a replay cannot know of: then the values are
  initialised, but not bit-equal to a normal build).

Memory per rank: the shards, plus the window (``max_gathered_bytes``), plus the buffers whole (they are
not partitioned); ``initialize`` then adopts the shards as it does ``Init``'s.
See note: shard memory build (docs/design-notes.md).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from ..collectives import Collectives
from ..parallel.registry import carry_marks
from . import init_shards
from .construction import Init, _GatherOnTouch

logger = logging.getLogger("zeroplus.zero")

MAX_GATHERED_BYTES = 0  # beyond the parameters of the operation at hand (construction.py)


def has_meta_tensors(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def is_hugging_face(model: torch.nn.Module) -> bool:
    return hasattr(model, "config") and callable(getattr(model, "post_init", None))


Cutter = Callable[[torch.Tensor], tuple[Callable[[torch.Tensor], torch.Tensor], Collectives] | None]


def materialize_meta(model: torch.nn.Module, group: Collectives, device: torch.device,
                     init_fn: Callable[[torch.nn.Module], None] | None = None,
                     max_gathered_bytes: int = MAX_GATHERED_BYTES, slice_of: Cutter | None = None) -> None:
    """Give a meta-device ``model`` its values (see the module docstring), partitioned over ``group``.
    ``slice_of(param)``: for a parameter that holds a slice of the one its config builds (a Hugging Face model
    split by its plans, ``parallel/plan_slices.py``), what cuts the slice from the whole and the group of ranks that
    hold the same slice (it is partitioned over them); None for the others."""
    if is_hugging_face(model) and init_fn is None:
        _rebuild(model, group, device, max_gathered_bytes, slice_of or (lambda p: None))
    elif slice_of is not None and any(slice_of(p) is not None for p in model.parameters()):
        raise ValueError("a meta-device model split by its plan is built again from its config (a Hugging Face "
                         "model, without init_fn=): the replay of init_fn cannot cut its slices")
    else:
        _replay(model, group, device, init_fn, max_gathered_bytes)


def _swap(model: torch.nn.Module, params: dict[int, torch.nn.Parameter], buffers: dict[int, torch.Tensor]) -> None:
    """Put the new tensors where the meta ones were, in every module that holds them (ties kept)."""
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in params:
                m._parameters[name] = params[id(p)]
        for name, b in m._buffers.items():
            if b is not None and id(b) in buffers:
                m._buffers[name] = buffers[id(b)]


def _rebuild(model: torch.nn.Module, group: Collectives, device: torch.device, max_gathered_bytes: int,
             slice_of: Cutter) -> None:
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    default = torch.get_default_dtype()
    if len(dtypes) == 1:
        torch.set_default_dtype(next(iter(dtypes)))
    try:
        with Init(data_parallel_group=group.group, max_gathered_bytes=max_gathered_bytes):
            built = type(model)(model.config)  # type: ignore[call-arg]
    finally:
        torch.set_default_dtype(default)
    mine = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(built.named_parameters(remove_duplicate=False))
    mine_b = dict(model.named_buffers(remove_duplicate=False))
    theirs_b = dict(built.named_buffers(remove_duplicate=False))
    def shape_as_built(n: str) -> torch.Size:  # (a slice's: cut from a meta stand-in of the whole)
        cut = slice_of(mine[n])
        return theirs[n].shape if cut is None else cut[0](torch.empty(theirs[n].shape, device="meta")).shape
    differ = sorted({n for n in mine.keys() ^ theirs.keys()} | {n for n in mine_b.keys() ^ theirs_b.keys()}
                    | {n for n in mine.keys() & theirs.keys()
                       if (mine[n].shape, mine[n].dtype) != (shape_as_built(n), theirs[n].dtype)})
    if differ:
        raise ValueError(f"the meta-device {type(model).__name__} differs from one built from its config in "
                         f"{differ[:8]}{' ...' if len(differ) > 8 else ''}: zeroplus builds a Hugging Face model "
                         f"again from its config to initialise it exactly; build it under zeroplus.Init instead, "
                         f"or pass init_fn= to replay an initialisation on the meta model as it is")
    params: dict[int, torch.nn.Parameter] = {}
    for n, p in mine.items():  # (the same order on every rank: the cuts gather over the group)
        cut = slice_of(p)
        if id(p) in params or cut is None:
            params.setdefault(id(p), theirs[n])
            continue
        piece = torch.nn.Parameter(cut[0](init_shards.gather(theirs[n])), requires_grad=p.requires_grad)
        init_shards.partition(piece, cut[1], device)  # (over the ranks that cut the same slice)
        carry_marks(p, piece)
        params[id(p)] = piece
    _swap(model, params, {id(mine_b[n]): theirs_b[n].to(device) for n in mine_b})


def _replay(model: torch.nn.Module, group: Collectives, device: torch.device,
            init_fn: Callable[[torch.nn.Module], None] | None, max_gathered_bytes: int) -> None:
    params: dict[int, torch.nn.Parameter] = {}
    owner: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in params:
            params[id(p)] = init_shards.blank(p.shape, p.dtype, device, group, p.requires_grad)
            owner[id(params[id(p)])] = name
    buffers: dict[int, torch.Tensor] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        if b.is_meta and id(b) not in buffers:
            buffers[id(b)] = torch.empty(b.shape, dtype=b.dtype, device=device)
            owner[id(buffers[id(b)])] = name
    _swap(model, params, buffers)
    versions = {id(b): b._version for b in buffers.values()}
    unreplayable = [n for n, m in model.named_modules()
                    if list(m.parameters(recurse=False)) and not callable(getattr(m, "reset_parameters", None))]
    if unreplayable:
        logger.warning("meta-device model: modules %s have parameters and no reset_parameters(); if their __init__ "
                       "draws random numbers, the replay cannot know it, and the values from there on are "
                       "initialised but not equal to a normal build", unreplayable[:8])
    window = _GatherOnTouch(max_gathered_bytes)
    with torch.no_grad(), window:
        for m in model.modules():
            owns = bool(list(m.parameters(recurse=False))) or bool(list(m.buffers(recurse=False)))
            reset = getattr(m, "reset_parameters", None)
            if owns and callable(reset):
                reset()
        if init_fn is not None:
            model.apply(init_fn)
    window.flush()
    unwritten = [owner[id(p)] for p in params.values() if init_shards.shard_of(p).blank]  # type: ignore[union-attr]
    unwritten += [owner[id(b)] for b in buffers.values() if b._version == versions[id(b)]]
    if unwritten:
        raise ValueError(f"meta-device model: {unwritten[:8]} were written by no reset_parameters() and no init_fn, "
                         f"so they would have no values; give initialize(..., init_fn=fn) that sets them, or build "
                         f"the model under zeroplus.Init")
