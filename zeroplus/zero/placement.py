"""Moving a model to the device and the compute dtype one partition unit at a time (``initialize``).

``initialize`` does not move or cast the whole model first. The partition (``zero/partition.py``) takes
the units one after another and, for each, calls ``UnitPlacement.prepare`` and then builds the unit's
flat groups:

- trainable parameters in an optimizer group are not moved here: their flat group copies them from
  wherever they are (host memory, another device) straight into its flat buffer on the device,
  casting as it copies, broadcasts that buffer from the group's first rank, takes its shard and (at
  stage 3) frees the buffer; the parameters become views of it;
- ``prepare`` moves the unit's other tensors (frozen parameters, parameters in no optimizer group,
  buffers) to the device, floating-point ones to the compute dtype (a ``Parameter`` subclass keeps its
  dtype: bitsandbytes packs 4-bit values into float storage), and broadcasts each from its
  group's first rank (an expert's from the expert-data group's), as ``model.to(device, dtype)`` and a
  broadcast of every tensor did for the whole model before.

Memory on the device while ``initialize`` runs (U: the largest unit's padded elements, c: bytes of the
compute dtype): the shards built so far, plus one unit's flat buffer (c * U), plus that unit's
non-flattened tensors; never the whole model. The model's own copy (on the host, or wherever it was
built) is released unit by unit as its parameters become views of the flat buffers, when nothing else
holds those tensors: a ``state_dict()`` or tensors the caller kept, weights shared with another model,
keep theirs alive, and then the host holds the whole model until they are dropped. Buffers and
frozen parameters on the host are released when moved, under the same condition.

An ``EmbeddingBagCollection``'s buffers are its rank's table shards (``zeroplus/embeddings``): they differ
between ranks and stay fp32, so the collection moves them itself and nothing is broadcast or cast.

A buffer registered in several modules stays one tensor (``Module.to`` would make two). A module's own
``_apply`` override is not called: tensors are moved one by one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..embeddings import EmbeddingBagCollection
from . import init_shards
from .quantized import move_quant_state


class UnitPlacement:
    """Moves each unit's non-flattened tensors to ``device`` (and ``dtype``) as the partition reaches it."""

    def __init__(self, device: torch.device, dtype: torch.dtype, group_of: Callable[[torch.Tensor], Any],
                 flattened: set[int]) -> None:
        """``group_of(tensor)``: the group whose first rank's values a tensor takes (the data group, an
        expert's expert-data group); ``flattened``: ids of the parameters the flat groups copy themselves."""
        self.device = device
        self.cast = dtype if dtype != torch.float32 else None  # like model.to(dtype) only for other dtypes
        self.group_of = group_of
        self.flattened = flattened
        self._moved: dict[int, torch.Tensor] = {}  # id of a tensor as given -> its tensor on the device

    def _convert(self, t: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        cast = self.cast if self.cast is not None and t.is_floating_point() and not keep_dtype else None
        return t.to(self.device, cast)

    def _broadcast(self, t: torch.Tensor) -> None:
        self.group_of(t).broadcast(t)

    def prepare(self, module: torch.nn.Module, exclude: list[torch.nn.Module]) -> None:
        """Move the tensors of ``module``'s subtree, without the subtrees of ``exclude`` (the other units,
        when ``module`` is the root)."""
        with torch.no_grad():
            for m in modules_outside(module, {id(e) for e in exclude if e is not module}):
                if isinstance(m, EmbeddingBagCollection):  # its own shards: moved, never cast or broadcast
                    m.to_device(self.device)
                    self._moved.update({id(b): b for b in m.buffers(recurse=False)})
                    continue
                for p in m._parameters.values():
                    if p is None or id(p) in self.flattened or id(p) in self._moved:
                        continue
                    self._moved[id(p)] = p
                    whole = init_shards.adopt(p) if init_shards.shard_of(p) is not None else p.data
                    # a Parameter subclass keeps its dtype: its storage may pack quantized values
                    # (bitsandbytes' Params4bit with bnb_4bit_quant_storage=float32), which a cast corrupts
                    p.data = self._convert(whole, keep_dtype=type(p) is not torch.nn.Parameter)
                    move_quant_state(p, self.device)  # (a 4-bit weight's statistics: quantized.py)
                    if p.grad is not None:
                        p.grad = self._convert(p.grad)
                    self._broadcast(p.data)
                for name, b in list(m._buffers.items()):
                    if b is None:
                        continue
                    if id(b) not in self._moved:
                        moved = self._convert(b)
                        self._broadcast(moved)
                        self._moved[id(b)] = moved
                    m._buffers[name] = self._moved[id(b)]


def modules_outside(module: torch.nn.Module, excluded: set[int]) -> list[torch.nn.Module]:
    """``module`` and its descendants, each once, without descending into modules whose id is excluded."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in seen or id(m) in excluded:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(reversed(list(m.children())))
    return out
