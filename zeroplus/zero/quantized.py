"""Quantized frozen weights (QLoRA's 4-bit base) partitioned at stage 3 in their storage dtype.

bitsandbytes' ``Params4bit`` is a ``Parameter`` subclass whose storage packs two 4-bit codes per byte,
in ``bnb_4bit_quant_storage`` (uint8 by default; FSDP recipes ask for the compute dtype so every
parameter of a layer has one dtype). Its ``quant_state`` (per-block absolute maxima, the code book)
is a Python object beside the tensor. The layer dequantizes the packed weight inside its own forward
(and again in backward), reading the parameter object's data at that moment.

At stage 3 such a weight joins its unit's frozen groups as raw storage: a flat group of its storage
dtype (``partition.py``: one frozen group per storage dtype), filled by byte-exact copies, broadcast
and all-gathered (a collective that copies and never sums; a cast would corrupt the codes: in float32
storage some of them are NaN bit patterns). It is gathered and released with its unit like any
frozen parameter, so the layer reads the whole packed weight only while its unit is gathered, and the
weight is never dequantized outside the layer's own forward and backward (which dequantize one layer
at a time, as without zeroplus).

Memory per rank for a 4-bit weight of n elements over N ranks: n / (2 N) bytes of packed shard, plus
its quant state whole on every rank (4 bytes per 64-element block, n / 16 bytes, or about n / 64
with bitsandbytes' nested quantization: ``bnb_4bit_use_double_quant``), plus n / 2 bytes while its
unit is gathered. A 7B base: 3.5 GB / N per rank instead of 3.5 GB.

Two things bitsandbytes does would break a partitioned weight, and are handled here:

- on a CPU with avx512_bf16, ``Linear4bit.forward`` in inference mode (``eval()``, no gradients)
  repacks the weight into another layout once, replacing the parameter's data and rewriting its quant
  state: the next gather would put the original layout back under the rewritten state, silently
  wrong. The repack is switched off for the layers whose weights are partitioned (their inference
  runs the training path: dequantize, then matmul); a weight already repacked before ``initialize``
  is refused, naming it.
- ``quant_state`` is not a tensor ``Module.to`` or the placement moves: it is moved with its weight here
  (``move_quant_state``, also for a weight kept whole at stages 0-2).
"""
from __future__ import annotations

from typing import Any

import torch

from ..parallel.registry import ParameterSet

_COPIES = ParameterSet()  # the memory estimate's meta copies of packed weights (``mark_packed_copy``)


def packed_storage(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is a quantized weight whose storage is packed codes that a flat group holds as raw
    storage: a quantized bitsandbytes ``Params4bit`` (its ``quant_state`` set), or the memory estimate's
    meta copy of one (``mark_packed_copy``)."""
    return (getattr(p, "bnb_quantized", False) and getattr(p, "quant_state", None) is not None) or p in _COPIES


def mark_packed_copy(copy: torch.nn.Parameter) -> None:
    """``copy`` (a plain meta ``Parameter`` standing in for a packed weight) is partitioned as the weight is."""
    _COPIES.add(copy)


def prepare_packed(name: str, p: torch.nn.Parameter, owner: torch.nn.Module, device: torch.device | None,
                   rank: int) -> None:
    """Before ``p`` is partitioned: refuse a weight already in bitsandbytes' CPU inference layout, switch
    that repack off for its layer (the weight's ``module``, else the module under ``owner`` holding it),
    and move its quant state to ``device``."""
    state: Any = getattr(p, "quant_state", None)  # (None on the estimate's meta copy)
    if getattr(state, "packing_format_for_cpu", False):
        raise ValueError(
            f"rank {rank}: the 4-bit weight {name} is in bitsandbytes' CPU inference layout (its layer ran a "
            f"forward in eval mode without gradients before zeroplus.initialize); a partitioned weight must "
            f"keep its storage layout. Call initialize before any eval-mode forward, or load the model again")
    layers = [getattr(p, "module", None)] + [m for m in owner.modules() if m._parameters.get("weight") is p]
    for layer in layers:
        if layer is not None and hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False  # (see the module note: inference repacks in place)
    move_quant_state(p, device)


def move_quant_state(p: torch.nn.Parameter, device: torch.device | None) -> None:
    """Move a quantized weight's quant state (absolute maxima, code book) to ``device`` (None: leave it)."""
    state: Any = getattr(p, "quant_state", None)
    if device is not None and state is not None and hasattr(state, "to"):
        state.to(device)
