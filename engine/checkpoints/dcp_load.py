"""A ``torch.distributed.checkpoint`` (DCP) checkpoint read into the engine's shards: what FSDP2 or torchtitan
saved, or zeroplus (``save_checkpoint(format="dcp")``, ``zeroplus convert --format dcp``).

Found by DCP's ``.metadata`` file (and no zeroplus ``metadata.json``): ``load_checkpoint(dir)`` where ``dir``
is the DCP directory, ``dir/tag``, or the tag ``dir/latest`` names. Entries are matched by name. The model's
parameters lie under one prefix ``P`` (``model.`` in ``get_state_dict``'s layout, ``app.model.`` in the DCP
tutorial's ``AppState``, nothing for a bare ``state_dict``): the prefix under which the most of this
engine's trained parameters are found (a tie is refused). Optimizer states lie under
``O + "state." + name + "." + key`` (a nested optimizer state dict and torchtitan's flattened one both
flatten to that), hyper-parameters under ``O + "param_groups.I.key"`` (nested) or
``O + "param_groups." + name + ".key"`` (flattened: each engine group takes its first parameter's).

Each rank reads, with a ``dcp.load`` of its own (``no_dist``: no collective), only the parameters that
overlap its owned range of some flat group, whole (DCP reassembles them from whatever shards wrote them),
their optimizer states, the step, and the buffers and frozen parameters this model has; ``load.py`` then
checks, agrees and applies as it does for zeroplus's own files. The step counters come from the optimizer's
``step`` (every trained parameter must have the same one: zeroplus keeps one per flat group); the schedule,
loss scale, RNG and client state are not in a DCP checkpoint: the engine's own are kept, and a schedule
kept while the step moves is logged.

Memory: the parameters overlapping this rank's owned range, whole, in fp32, with each optimizer state (Adam:
12 bytes per element of the owned range plus of the parameters cut at its two ends), and the buffers and
frozen parameters; released when the load ends.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from . import files as io

logger = logging.getLogger("zeroplus.checkpoint")


def dcp_dir(load_dir: str, tag: str | None) -> str | None:
    """The DCP checkpoint directory a load of ``(load_dir, tag)`` means, or None where that is not one."""
    def is_dcp(path: str) -> bool:
        return os.path.isfile(os.path.join(path, io.DCP_METADATA)) and \
            not os.path.isfile(os.path.join(path, io.METADATA))
    if tag is not None:
        path = os.path.join(load_dir, tag)
        return path if is_dcp(path) else None
    if is_dcp(load_dir):
        return load_dir
    latest = os.path.join(load_dir, io.LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(load_dir, f.read().strip())
        return path if is_dcp(path) else None
    return None


def _prefix(keys: set[str], names: list[str], what: str, path: str) -> str:
    """The prefix under which the most of ``names`` are keys (refusing a tie: two models in one checkpoint)."""
    counts: dict[str, int] = {}
    for key in keys:
        for name in names[:1]:
            if key == name or key.endswith("." + name):
                counts[key[:len(key) - len(name)]] = 0
    for prefix in counts:
        counts[prefix] = sum(prefix + n in keys for n in names)
    best = max(counts.values(), default=0)
    found = sorted(p for p, c in counts.items() if c == best)
    if best == 0:
        shown = ", ".join(sorted(keys)[:6])
        raise ValueError(f"DCP checkpoint {path} holds none of this model's {what} (looked for {names[0]!r} under "
                         f"any prefix; its entries include {shown})")
    if len(found) > 1:
        raise ValueError(f"DCP checkpoint {path} holds this model's {what} under several prefixes {found}: which one "
                         f"to load is ambiguous")
    return found[0]


def _optim_stem(keys: set[str], names: list[str], path: str) -> str:
    """The ``O`` under which the optimizer states lie (``O + "state." + name + "." + key``): the one holding
    states for the most of ``names``."""
    mark = f"state.{names[0]}."
    stems = {k[:k.index(mark)] for k in keys if mark in k and "." not in k[k.index(mark) + len(mark):]
             and (k.index(mark) == 0 or k[k.index(mark) - 1] == ".")}
    if not stems:
        raise ValueError(f"DCP checkpoint {path} holds no optimizer state for {names[0]!r}: load it with "
                         f"load_optimizer_states=False (or load_module_only=True)")
    wanted = set(names)
    counts = {s: len(wanted & {k[len(s) + 6:].rsplit(".", 1)[0] for k in keys if k.startswith(s + "state.")})
              for s in stems}
    best = max(counts.values())
    found = sorted(s for s, c in counts.items() if c == best)
    if len(found) > 1:
        raise ValueError(f"DCP checkpoint {path} holds optimizer states under several prefixes {found}: which one "
                         f"to load is ambiguous")
    return found[0]


class DcpCheckpoint:
    """One DCP checkpoint's metadata, and the names under which this engine's state lies in it."""

    def __init__(self, path: str, trained: dict[str, tuple[int, ...]], load_optim: bool) -> None:
        self.path = path
        self.entries = FileSystemReader(path).read_metadata().state_dict_metadata
        tensors = {k for k, v in self.entries.items() if isinstance(v, TensorStorageMetadata)}
        names = list(trained)
        self.model = _prefix(tensors, names, "parameters", path) if names else ""
        self.optim = _optim_stem(tensors, names, path) if load_optim and names else None
        self.sizes = {k[len(self.model):]: tuple(v.size) for k, v in self.entries.items()
                      if k.startswith(self.model) and isinstance(v, TensorStorageMetadata)}

    def state_keys(self, name: str) -> list[str]:
        """The optimizer-state keys saved for parameter ``name`` (``exp_avg``, ``step``, ...)."""
        if self.optim is None:
            return []
        stem = f"{self.optim}state.{name}."
        return [k[len(stem):] for k in self.entries if k.startswith(stem) and "." not in k[len(stem):]]

    def layout(self, trained: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """The checkpoint as ``load.py``'s metadata: one group per trained parameter found, one saved range
        each (its "rank" is its index); parameters with optimizer state but not in this model are listed
        (``_check_layout`` names them unexpected)."""
        found = [n for n in trained if n in self.sizes]
        if self.optim is not None:
            stem = f"{self.optim}state."
            found += sorted({k[len(stem):].rsplit(".", 1)[0] for k in self.entries if k.startswith(stem)}
                            - set(trained))
            found = list(dict.fromkeys(n for n in found if n in self.sizes))
        self.order = found
        return {"world_size": 1, "groups": [
            {"name": n, "params": [[n, list(self.sizes[n]), 0]], "ranges": [[i, 0, _numel(self.sizes[n])]]}
            for i, n in enumerate(found)]}

    def _template(self, key: str) -> Any:
        md = self.entries[key]
        if isinstance(md, BytesStorageMetadata):
            return None
        return torch.empty(md.size, dtype=md.properties.dtype)

    def read(self, keys: list[str]) -> dict[str, Any]:
        """``keys`` (whole entries) from the checkpoint, in one ``dcp.load`` without collectives."""
        if not keys:
            return {}
        state = {k: self._template(k) for k in keys}
        with warnings.catch_warnings():  # DCP warns that no_dist reads in one process: what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=self.path, no_dist=True)
        return state

    def read_model(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Model entries ``names`` (buffers, frozen parameters) as saved."""
        values = self.read([self.model + n for n in names])
        return {n: values[self.model + n] for n in names}

    def parameters(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Each of ``names`` as a saved range of ``load.py``: ``{"lo", "hi", "master", "sliced", "whole"}``,
        the master and per-element states flat fp32."""
        keys = {n: {"": self.model + n, **{s: f"{self.optim}state.{n}.{s}" for s in self.state_keys(n)}}
                for n in names}
        values = self.read([k for per in keys.values() for k in per.values()])
        out = {}
        for n, per in keys.items():
            master = values[per[""]].reshape(-1).float()
            sliced, whole = {}, {}
            for s, k in per.items():
                if not s:
                    continue
                v = values[k]
                if isinstance(v, torch.Tensor) and v.numel() == master.numel() and v.dim() > 0:
                    sliced[s] = v.reshape(-1).float()
                else:
                    whole[s] = v
            out[n] = {"lo": 0, "hi": master.numel(), "master": master, "sliced": sliced, "whole": whole}
        return out

    def hparams(self, groups: list[list[str]]) -> list[dict[str, Any]]:
        """Each engine param group's hyper-parameters (``groups``: its parameters' names), [] if none saved."""
        if self.optim is None:
            return []
        stem = f"{self.optim}param_groups."
        nested = sorted(int(k[len(stem):-len(".params")]) for k in self.entries
                        if k.startswith(stem) and k.endswith(".params") and k[len(stem):-len(".params")].isdigit())
        if nested:
            keys = [[k for k in self.entries if k.startswith(f"{stem}{i}.") and not k.endswith(".params")]
                    for i in nested]
            values = self.read([k for per in keys for k in per])
            return [{k[len(f"{stem}{i}."):]: values[k] for k in per} for i, per in zip(nested, keys)]
        keys = [[k for k in self.entries if names and k.startswith(f"{stem}{names[0]}.")
                 and "." not in k[len(f"{stem}{names[0]}."):]] for names in groups]
        values = self.read([k for per in keys for k in per])
        return [{k.rsplit(".", 1)[1]: values[k] for k in per} for per in keys]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class DcpFiles:
    """``load.py``'s view of the saved ranges: "rank" ``i`` is parameter ``order[i]``, read when first asked for
    (the parameters a rank needs are read together by ``preload``)."""

    def __init__(self, ckpt: DcpCheckpoint) -> None:
        self.ckpt = ckpt
        self._read: dict[str, dict[str, Any]] = {}

    def preload(self, names: list[str]) -> None:
        self._read.update(self.ckpt.parameters([n for n in names if n not in self._read]))

    def name(self, rank: int) -> str:
        return f"{self.ckpt.path} (parameter {self.ckpt.order[rank]!r})"

    def get(self, rank: int) -> dict[str, Any]:
        name = self.ckpt.order[rank]
        if name not in self._read:
            self.preload([name])
        return {"groups": {name: self._read[name]}}

    def check_states(self) -> set[float]:
        """Refuse parameters read without the optimizer states the others have, or with another step (a flat
        group keeps one); return the steps (one value, or none saved)."""
        kinds = {name: tuple(sorted(s["sliced"])) + tuple(sorted(s["whole"])) for name, s in self._read.items()}
        common = max(set(kinds.values()), key=list(kinds.values()).count, default=())
        odd = sorted(n for n, k in kinds.items() if k != common)
        if odd:
            raise ValueError(f"DCP checkpoint {self.ckpt.path}: parameters {odd[:4]} have optimizer states "
                             f"{[kinds[n] for n in odd[:4]]}, the others {common}: load it with "
                             f"load_optimizer_states=False")
        steps = {float(s["whole"]["step"]) for s in self._read.values() if "step" in s["whole"]}
        if len(steps) > 1:
            raise ValueError(f"DCP checkpoint {self.ckpt.path}: its parameters were stepped {sorted(steps)} times; "
                             f"zeroplus keeps one step per group of parameters and cannot resume them exactly")
        return steps
