"""``engine.load_pretrained(path)``: a Hugging Face checkpoint read straight into each rank's shards.

    engine = zeroplus.initialize(meta_model, "ds_config.json")     # or built under zeroplus.Init
    engine.load_pretrained("llama-7b/")                             # safetensors or .bin, one file or sharded

``path``: a directory holding ``model.safetensors.index.json``, ``model.safetensors``,
``pytorch_model.bin.index.json`` or ``pytorch_model.bin`` (first found, in that order), or one of
those files. Each rank reads only what it keeps: for every trainable parameter, the elements in this
rank's shard (safetensors: exactly those bytes, by ``pread``, ``safetensors_ranges.py``; a ``.bin`` file
is opened with ``torch.load(mmap=True, weights_only=True)``, so slicing it reads those pages only), cast to the
parameter's dtype as built and written into the fp32 master shard; the compute-dtype copies then
follow the masters as after a checkpoint load (stages 1-2 all-gather them; stage 3 gathers when it
computes). Frozen parameters at stage 3 are read into their shards the same way; at stages 0-2 they
and persistent buffers, which every rank keeps whole, are read whole.
The result equals ``model.load_state_dict(state)`` before ``initialize``, bit for bit.
A Hugging Face model split by its plans (AutoTP, AutoEP: ``zeroplus/parallel/plan_slices.py``; built normally or on
the meta device) reads the files' whole tensors: each rank takes its slice's runs of each
(``plan_slices.SlicePart``), in windows of at most ``WINDOW`` elements where they lie close, so a column cut reads
little more than its columns.

Names are strict: a parameter or persistent buffer the files lack, and a name in the files that is no
tensor of the model, are one error listing both (a tied parameter is found under any of its names, so
GPT-2's files without ``lm_head.weight`` load). ``prefixes={"transformer.": ""}`` renames the files'
names (each file name starting with a key has it replaced by the value); ``allow_missing=["lm_head.*"]``
lets parameters matching those patterns keep their values; ``strict=False`` ignores unexpected names.
A shape that differs is an error naming the parameter, both shapes and the file. Everything is checked,
on every rank, before anything is written: a refused load leaves the engine as it was.

Memory per rank: this rank's part of one parameter at a time, plus frozen parameters and buffers one at a
time (and for ``.bin`` files the mapped pages read, which count in resident memory until the load ends).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from typing import TYPE_CHECKING, Any, Iterable

import torch

from zeroplus.parallel.plan_slices import SlicePart, slicing

from .safetensors_ranges import SafetensorsFile

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses

WINDOW = 1 << 22  # elements: an AutoTP slice's runs read together when the window spanning them is this or less
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")


@dataclasses.dataclass
class PretrainedLoad:
    """What ``load_pretrained`` did: names read, names allowed missing, names in the files ignored."""

    path: str
    loaded: list[str]
    missing: list[str]
    unexpected: list[str]


class _Files:
    """The tensors of a checkpoint, by name: shape and ranged reads, across its files."""

    def __init__(self, path: str) -> None:
        self.path = _weights_path(path)
        if self.path.endswith(".index.json"):
            with open(self.path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            folder = os.path.dirname(self.path)
            self.file_of = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        else:
            self.file_of = {name: self.path for name in _open(self.path).keys()}
        self._handles: dict[str, Any] = {}

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = _open(file)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        handle = self._handle(self.file_of[name])
        return tuple(handle[name].shape) if isinstance(handle, dict) else handle.shape(name)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor (safetensors: those bytes, by ``pread``; a
        ``.bin`` file's memory-mapped tensor: sliced, so only those pages are read)."""
        handle = self._handle(self.file_of[name])
        if isinstance(handle, dict):
            return handle[name].reshape(-1)[start:end]
        return handle.read(name, start, end)


def _weights_path(path: str) -> str:
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: {path!r} is neither a file nor a directory")
    for name in WEIGHT_FILES:
        candidate = os.path.join(path, name)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"load_pretrained: directory {path!r} has none of {list(WEIGHT_FILES)}")


def _open(file: str) -> Any:
    if file.endswith(".safetensors"):
        return SafetensorsFile(file)
    return torch.load(file, map_location="cpu", mmap=True, weights_only=True)


@dataclasses.dataclass
class _Target:
    names: list[str]          # every name the model knows this tensor by (ties)
    shape: tuple[int, ...]    # in the files: the whole tensor's (an AutoTP slice's whole)
    dtype: torch.dtype        # as built: values are cast to it first, as load_state_dict would
    group: Any = None         # the flat group holding it (trained, or stage 3's frozen), else None
    index: int = -1           # its index in that group
    tensor: torch.Tensor | None = None  # a frozen parameter or a buffer, kept whole on every rank
    part: SlicePart | None = None  # an AutoTP slice: which elements of the whole are this rank's


def _targets(engine: Engine, of: Any) -> list[_Target]:
    aliases: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)

    def part(p: torch.Tensor, shape: tuple[int, ...]) -> SlicePart | None:
        cut = of(p) if of is not None else None
        return None if cut is None else SlicePart(shape, cut.cut, cut.group.rank, cut.group.size)
    out: list[_Target] = []
    flat: set[int] = set()
    for g in engine.partition.groups + engine.partition.frozen:  # (stage 3's frozen groups: into their shards)
        for i, p in enumerate(g.params):
            flat.add(id(p))
            mine = part(p, tuple(g.shapes[i]))
            out.append(_Target(aliases[id(p)], mine.whole_shape if mine else tuple(g.shapes[i]), g.dtypes[i], g, i,
                               part=mine))
    for p in dict(engine.module.named_parameters()).values():
        if id(p) not in flat:
            mine = part(p, tuple(p.shape))
            out.append(_Target(aliases[id(p)], mine.whole_shape if mine else tuple(p.shape), p.dtype, tensor=p,
                               part=mine))
    for module_name, m in engine.module.named_modules():  # (not state_dict(): at stage 3 it gathers)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                full = f"{module_name}.{name}" if module_name else name
                out.append(_Target([full], tuple(b.shape), b.dtype, tensor=b))
    return out


def _plan(engine: Engine, files: _Files, prefixes: dict[str, str], allow_missing: list[str],
          strict: bool, of: Any) -> tuple[list[tuple[_Target, str]], PretrainedLoad]:
    renamed: dict[str, str] = {}
    for name in files.file_of:
        new = name
        for old, replacement in prefixes.items():
            if name.startswith(old):
                new = replacement + name[len(old):]
                break
        renamed[new] = name
    plan, missing, used, problems = [], [], set(), []
    for target in _targets(engine, of):
        found = next((n for n in target.names if n in renamed), None)
        if found is None:
            if any(fnmatch.fnmatchcase(n, pattern) for n in target.names for pattern in allow_missing):
                missing.append(target.names[0])
                continue
            problems.append(f"missing {target.names[0]}")
            continue
        used.add(found)
        file_name = renamed[found]
        shape = files.shape(file_name)
        if tuple(shape) != target.shape:
            problems.append(f"parameter {found}: shape {tuple(shape)} in {files.file_of[file_name]}, "
                            f"{target.shape} in the model")
            continue
        plan.append((target, file_name))
    unexpected = sorted(n for n in renamed if n not in used)
    if unexpected and strict:
        problems.append(f"unexpected {unexpected[:16]}{' ...' if len(unexpected) > 16 else ''}")
    if problems:
        raise ValueError(f"load_pretrained({files.path!r}) on rank {engine.dp.rank}: " + "; ".join(problems[:24])
                         + (f" (and {len(problems) - 24} more)" if len(problems) > 24 else "")
                         + ". Nothing was loaded (prefixes= renames the files' names, allow_missing= lets "
                         "parameters keep their values, strict=False ignores unexpected names)" + _experts_hint(
                             engine, unexpected))
    return plan, PretrainedLoad(files.path, [t.names[0] for t, _ in plan], missing, unexpected)


def _read(files: _Files, name: str, target: _Target, start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of what this rank holds of ``name``: of the whole tensor, or of its AutoTP slice
    (the runs of the whole that make it up, read in windows of at most ``WINDOW`` elements where they are close)."""
    if target.part is None or end <= start:
        return files.read(name, start, max(start, end))
    pieces = []
    for first, last, picks in target.part.windows(start, end, WINDOW):
        window = files.read(name, first, last)
        pieces += [window[a - first:b - first] for a, b in picks]
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def _experts_hint(engine: Engine, unexpected: list[str]) -> str:
    """A model with packed 3-D experts and files with one tensor per expert (the layout Transformers 5's
    ``save_pretrained`` still writes and its ``from_pretrained`` converts): say so."""
    packed = any(len(s) == 3 and "experts" in n for g in engine.partition.groups for n, s in zip(g.names, g.shapes))
    if packed and any(re.search(r"\.experts\.\d+\.", n) for n in unexpected):
        return (". The files hold one tensor per expert, the model packs each layer's experts into 3-D "
                "parameters: converting at load is not built yet; write the packed layout (the model's own "
                "state_dict(), or engine.save_16bit_model) and load that")
    return ""


def load_pretrained(engine: Engine, path: str, *, prefixes: dict[str, str] | None = None,
                    allow_missing: Iterable[str] = (), strict: bool = True) -> PretrainedLoad:
    """Every rank calls it (see the module docstring)."""
    of = slicing(engine.module, engine.parallel, "load_pretrained() reads whole-model names")
    engine.partition.wait_all()
    outcome: Any = None
    try:
        files = _Files(path)
        plan, result = _plan(engine, files, dict(prefixes or {}), list(allow_missing), strict, of)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        outcome = f"{type(err).__name__}: {err}"
    failures = [o for o in engine.dp.all_gather_objects(outcome) if o is not None]
    if failures:
        raise ValueError(failures[0] if outcome is None else outcome)
    with torch.no_grad():
        for target, name in plan:
            if target.tensor is not None:
                numel = target.tensor.numel()
                target.tensor.copy_(_read(files, name, target, 0, numel).view(target.tensor.shape))
                continue
            g = target.group
            for i, at, end in g.param_segments():
                if i != target.index:
                    continue
                local = g.owned_start + at - g.offsets[i]
                values = _read(files, name, target, local, local + end - at).to(target.dtype).to(torch.float32)
                g.master_store.write(at, values)
    engine.partition.params_from_masters()
    return result
