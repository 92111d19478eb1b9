"""The live engine saved as a ``torch.distributed.checkpoint`` (DCP): ``save_checkpoint(dir, format="dcp")``.

The layout is FSDP2's (``get_state_dict(model, optimizer)`` with torch's AdamW), so FSDP2 and torchtitan load
it with ``dcp.load`` at any world size and zeroplus loads it back at any stage (``dcp_load.py``)::

    {"model": {fqn: fp32 tensor},
     "optim": {"state": {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [fqn]}]}}

No rank gathers anything. Each rank writes what the native format has it write (``save.py``): its nominal
range of every flat group, masters and per-element optimizer states. DCP records a shard as a box (offsets
and sizes per dimension) of the tensor, so the part of a parameter that falls in a rank's flat range is cut
into the boxes that tile it in row-major order (``flat_boxes``: at most ``2 * (d - 1) + 1`` for a
``d``-dimensional parameter: a partial row at each level, whole rows between). DCP's planner checks that the
boxes of all ranks tile every tensor. Each parameter's step and the hyper-parameters are written once (DCP
keeps one copy of what several ranks give), buffers and frozen parameters by rank 0, tied weights under every
name the model's ``state_dict`` uses (optimizer states under the first).

Memory: the native save's (the boxes are views of the rank's own buffers; a copy of the range where the
master is stored split), plus DCP's write buffers.
See note: dcp boxes (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
import math
import re
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .hf_export import tied_aliases

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]  # offsets, sizes, first and end flat index
_GROUP_INDEX = re.compile(r"#(\d+)")


def param_group_of(group_name: str) -> int:
    """The optimizer param group a flat group belongs to (its name's ``#I``; 0 without one)."""
    index = _GROUP_INDEX.search(group_name)
    return int(index.group(1)) if index else 0


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """The boxes that tile elements ``[lo, hi)`` of a row-major tensor of ``shape``, in flat order (each is
    the contiguous run ``flat[start:end]`` viewed as ``sizes``)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) * len(shape), (hi - lo,) * len(shape), lo, hi)]
    row = math.prod(shape[1:])
    rest = len(shape) - 1

    def within(r: int, a: int, b: int) -> list[Box]:
        return [((r, *o), (1, *s), r * row + x, r * row + y) for o, s, x, y in flat_boxes(shape[1:], a, b)]

    first, last = lo // row, hi // row  # ``last``: the row where ``hi`` falls (partial if hi % row)
    if first == (hi - 1) // row:
        return within(first, lo - first * row, hi - first * row)
    boxes: list[Box] = []
    whole_from = first
    if lo % row:
        boxes += within(first, lo % row, row)
        whole_from += 1
    if last > whole_from:
        boxes.append(((whole_from, *(0,) * rest), (last - whole_from, *shape[1:]), whole_from * row, last * row))
    if hi % row:
        boxes += within(last, 0, hi % row)
    return boxes


class _RangePlanner(DefaultSavePlanner):
    """DCP's default planner plus this rank's boxes, which it writes without their whole tensors."""

    def __init__(self, boxes: dict[str, list[tuple[torch.Size, torch.Tensor]]], shapes: dict[str, torch.Size]):
        super().__init__()
        self._boxes = {fqn: {offsets: t for offsets, t in pieces} for fqn, pieces in boxes.items()}
        self._items = [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                 tensor_data=TensorWriteData(
                                     chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                     properties=TensorProperties.create_from_tensor(t), size=shapes[fqn]))
                       for fqn, pieces in boxes.items() for offsets, t in pieces]
        self._paths = {fqn: tuple(fqn.split(".", 1)) if fqn.startswith("model.") else _optim_path(fqn)
                       for fqn in boxes}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        data = {**(plan.planner_data or {}), **self._paths}
        self.plan = dataclasses.replace(plan, items=[*plan.items, *self._items], planner_data=data)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        pieces = self._boxes.get(index.fqn)
        if pieces is None:
            return super().lookup_object(index)
        return pieces[torch.Size(index.offset or ())]


def _optim_path(fqn: str) -> tuple[str, ...]:
    """``optim.state.NAME.KEY`` as the nested path ``get_state_dict`` gives it (what DCP's metadata records to
    rebuild the nesting)."""
    head, key = fqn.rsplit(".", 1)
    return ("optim", "state", head[len("optim.state."):], key)


def write_dcp(engine: Engine, directory: str, state: dict[str, Any], process_group: Any) -> None:
    """Every rank of the data group: write ``directory`` as a DCP checkpoint from ``state`` (this rank's
    ``save.rank_state``: its nominal ranges). Collective; DCP raises on every rank if any rank fails."""
    groups = {g.name: g for g in engine.partition.groups}
    aliases: dict[str, list[str]] = {}
    for alias, name in tied_aliases(engine.module).items():
        aliases.setdefault(name, []).append(alias)
    boxes: dict[str, list[tuple[torch.Size, torch.Tensor]]] = {}
    shapes: dict[str, torch.Size] = {}
    model: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    params: dict[int, list[str]] = {i: [] for i in range(len(engine.optimizer.param_groups))}
    for name, saved in state["groups"].items():
        g = groups[name]
        lo, hi = saved["lo"], saved["hi"]
        for pname, shape, offset, numel in zip(g.names, g.shapes, g.offsets, g.numels):
            params.setdefault(param_group_of(name), []).append(pname)
            s, e = max(offset, lo), min(offset + numel, hi)
            tensors = {f"model.{n}": saved["master"] for n in [pname, *aliases.get(pname, [])]}
            tensors.update({f"optim.state.{pname}.{k}": v for k, v in saved["sliced"].items()})
            for fqn, flat in tensors.items():
                shapes[fqn] = torch.Size(shape)
                boxes.setdefault(fqn, []).extend(
                    (torch.Size(o), flat[offset + x - lo:offset + y - lo].view(sz))
                    for o, sz, x, y in flat_boxes(tuple(shape), s - offset, e - offset))
            optim_state[pname] = {k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                                  for k, v in saved["whole"].items()}
    model.update(state["module_extra"])
    param_groups = [dict(pg, params=params.get(i, [])) for i, pg in enumerate(state["optimizer_hparams"])]
    nested = {"model": model, "optim": {"state": optim_state, "param_groups": param_groups}}
    with warnings.catch_warnings():  # DCP warns that a process without a group saves alone: what is meant here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(nested, checkpoint_id=directory, planner=_RangePlanner(boxes, shapes),
                 process_group=process_group, no_dist=not engine.dp.initialized)
