"""Ulysses context parallelism for Hugging Face causal LMs (Llama, Qwen2, Mistral, Mixtral, ...).

    ulysses_hf(model, groups.context)     # zeroplus.initialize does this under "context": C

Two changes to the model instance, nothing else: (1) an attention implementation registered with
Transformers' ``AttentionInterface`` wraps the model's own (``sdpa``/``eager``): Q, K and V arrive
as this rank's tokens of all heads, go through ``seq_to_heads`` (``context.py``; K and V with their
own, fewer heads under grouped-query attention), attention runs causally over the whole sequence
for H/C heads, and the output comes back through ``heads_to_seq``. (2) The forward takes the whole
sequences, as every rank of a context group is given them, and passes on this rank's contiguous
slice: the input ids, the global position ids (so rotary embeddings rotate by the global position)
and the labels shifted over the whole sequence before slicing (``shift_labels``: the last token of a
slice predicts the first of the next one). Each rank's loss is the sum over its tokens divided by 1/C
of the counted tokens of the whole sequences (or of the trainer's ``num_items_in_batch``), so that
the mean over the context ranks, which the engine's gradient average forms, is the mean over every
token: exact also when ignored labels (-100) fall unevenly.

Padding is refused (an attention mask with zeros: the causal attention over the gathered sequence
has no mask); so is a head count not divisible by C. Memory and communication: ``context.py``.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

from ..activations.tiled_loss import IGNORE_INDEX, shifted
from ..comm import DataParallelGroup
from .context import check_heads, heads_to_seq, local_slice, seq_to_heads

transformers: Any
try:
    import transformers
except ImportError:  # transformers is optional: only its models need this
    transformers = None

NAME = "zeroplus_ulysses"


def ulysses_attention(inner: Callable[..., Any], group: DataParallelGroup) -> Callable[..., Any]:
    """An attention function (Transformers' signature) running ``inner`` over the whole sequence for
    this rank's heads."""
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        q, k, v = (seq_to_heads(t.transpose(1, 2), group).transpose(1, 2) for t in (query, key, value))
        kwargs.pop("is_causal", None)
        out, weights = inner(module, q, k, v, None, is_causal=True, **kwargs)  # out: (b, s, H/C, hd)
        return heads_to_seq(out, group), weights
    return attention


def ulysses_hf(model: nn.Module, group: DataParallelGroup) -> None:
    """Give a Hugging Face causal LM instance Ulysses attention over ``group`` (module docstring)."""
    if transformers is None:
        raise ValueError("context parallelism for a Hugging Face model needs the transformers package")
    config: Any = getattr(model, "config")
    heads = int(config.num_attention_heads)
    check_heads(heads, int(getattr(config, "num_key_value_heads", None) or heads), group)
    inner = transformers.AttentionInterface._global_mapping.get(config._attn_implementation)
    if inner is None:
        inner = transformers.integrations.sdpa_attention.sdpa_attention_forward  # eager and unknown: sdpa's math
    name = f"{NAME}_{id(model)}"
    transformers.AttentionInterface.register(name, ulysses_attention(inner, group))
    config._attn_implementation = name
    original = model.forward

    def forward(self: nn.Module, input_ids: torch.Tensor | None = None, *args: Any, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if input_ids is None:
            raise ValueError("context parallelism: give input_ids (whole sequences; each rank keeps its slice)")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("context parallelism: padded sequences (attention_mask with zeros) are not supported")
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        if labels is not None:
            shift = kwargs.pop("shift_labels", None)
            whole = shifted(labels) if shift is None else shift
            items = kwargs.pop("num_items_in_batch", None)
            items = (whole != IGNORE_INDEX).sum() if items is None else items
            # each rank divides its tokens' sum by 1/C of the count: the engine's mean over the C ranks is then
            # the mean over every token, however the ignored ones fall
            kwargs["num_items_in_batch"] = items / group.size
            kwargs["shift_labels"] = local_slice(whole, group).contiguous()  # (HF views it flat)
            labels = local_slice(labels, group)
        return original(local_slice(input_ids, group), *args, labels=labels,
                        position_ids=local_slice(position_ids, group), **kwargs)

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


__all__ = ["ulysses_attention", "ulysses_hf"]
