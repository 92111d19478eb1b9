"""Context parallelism for Hugging Face causal LMs (Llama, Qwen2, Mistral, Mixtral, ...).

    context_parallel_hf(model, groups.context, "ulysses")   # zeroplus.initialize does this under "context": C

Two changes to the model instance, nothing else: (1) an attention implementation registered with
Transformers' ``AttentionInterface``. Ulysses wraps the model's own (``sdpa``/``eager``): Q, K and V
arrive as this rank's tokens of all heads, go through ``seq_to_heads`` (``context.py``; K and V with
their own, fewer heads under grouped-query attention, or repeated to one per query head where their
number does not divide by C), attention runs causally over the whole
sequence for H/C heads, and the output comes back through ``heads_to_seq``. Ring runs
``ring_attention`` (``ring_attention.py``) on this rank's zigzag tokens, K and V repeated to the query
heads under grouped-query attention. (2) The forward takes the whole sequences, as every rank of a
context group is given them, and passes on this rank's part (contiguous for Ulysses, the zigzag
chunks for ring): the input ids, the global position ids (so rotary embeddings rotate by the global
position) and the labels shifted over the whole sequence before splitting (``shift_labels``: the
last token of a part predicts the first token after it). Each rank's loss is the sum over its tokens divided by 1/C
of the counted tokens of the whole sequences (or of the trainer's ``num_items_in_batch``), so that
the mean over the context ranks, which the engine's gradient average forms, is the mean over every
token: exact also when ignored labels (-100) fall unevenly.

A sliding window (``sliding_window``, as the layer passes it) is applied on every path: the ring's blocks skip
and mask by it, and Ulysses with a window runs them on one rank over its heads (``windowed_attention``). Padding
is refused (an attention mask with zeros: the causal attention over the gathered sequence has no mask), and so
are a custom mask, packed sequences' position ids, and the attention arguments no path applies
(``check_attention_call``); so is a head count not divisible by C. Memory and communication: ``context.py``.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

from ..activations.tiled_loss import IGNORE_INDEX, shifted
from ..comm import DataParallelGroup
from ..parallel.context import check_heads, local_slice, seq_to_heads
from ..parallel.ring_attention import ring_attention, windowed_attention, zigzag_slice
from ..parallel.ulysses_output import output_exchanged

transformers: Any
try:  # with ``import zeroplus``, on purpose: the budget's baseline then holds it whether or not the script imported
    import transformers  # it before building its model (tests/budget/test_budget_in_process.py; note 63's reasoning)
except ImportError:  # transformers is optional: only its models need this
    transformers = None

NAME = "zeroplus_context"


# The arguments Transformers' attention functions (eager, sdpa, flash, flex) read that change what attention
# computes and that no path here applies: logit softcapping (Gemma 2), attention sinks (GPT-OSS), packed sequences'
# boundaries, paged caches, flex's score modifiers, head masks, returned attention weights. The scale, dropout
# (Ulysses: the model's own attention applies it; the ring refuses a rate above 0), the sliding window and
# causality are honoured; what else the layers pass along (positions already applied, the loss's arguments, cache
# flags) does not change the attention.
_NOT_HONOURED = frozenset({"softcap", "s_aux", "sinks", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                           "max_length_k", "block_table", "k_cache", "v_cache", "cache", "kernel_options",
                           "score_mod", "block_mask", "head_mask", "output_attentions", "attention_chunk_size"})


def check_attention_call(module: nn.Module, kwargs: dict[str, Any], path: str, dropout_ok: bool) -> int | None:
    """Refuse, at the forward that meets it, an attention argument the ``path`` ("Ulysses", "ring", "hybrid") does
    not honour (``_NOT_HONOURED`` with a value set, a non-causal layer, dropout on the ring). Returns the sliding
    window (None: none), which every path honours."""
    name = type(module).__name__
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise ValueError(f"context parallelism ({path}): {name} is not causal; only causal attention is split")
    if not dropout_ok and float(kwargs.get("dropout") or 0.0) > 0.0:
        raise ValueError(f"context parallelism ({path}): {name} asks for attention dropout {kwargs['dropout']}, which "
                         f"ring attention does not apply; set the model's attention dropout to 0 or use Ulysses")
    unknown = sorted(k for k, v in kwargs.items() if k in _NOT_HONOURED and v is not None and v is not False)
    if unknown:
        raise ValueError(f"context parallelism ({path}): {name} passes attention arguments {unknown} "
                         f"({', '.join(f'{k}={kwargs[k]!r}' for k in unknown)[:200]}), which the split attention does "
                         f"not honour (softcap: logit softcapping; s_aux, sinks: attention sinks; cu_seq_lens_*: "
                         f"packed sequences); it would compute other attention than one process, so it is refused")
    window = kwargs.get("sliding_window")
    return None if window is None else int(window)


def binding(window: int | None, length: int) -> int | None:
    """The window if it masks anything in a sequence of ``length`` tokens (else None: plain causal attention, its
    faster path; Mistral-7B's window of 4096 on shorter sequences)."""
    return window if window is not None and window < length else None


def ulysses_attention(inner: Callable[..., Any], group: DataParallelGroup) -> Callable[..., Any]:
    """An attention function (Transformers' signature) running ``inner`` over the whole sequence for
    this rank's heads (with a sliding window: the ring's blocks on one rank, ``windowed_attention``)."""
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        window = binding(check_attention_call(module, kwargs, "Ulysses", dropout_ok=True), query.shape[2] * group.size)
        if window is not None and float(kwargs.get("dropout") or 0.0) > 0.0:
            raise ValueError(f"context parallelism (Ulysses): {type(module).__name__} asks for attention dropout "
                             f"{kwargs['dropout']} with a sliding window, which the windowed blocks do not apply")
        repeated = key.shape[1] % group.size != 0  # fewer key/value heads than C splits: one per query head
        if repeated or window is not None:
            key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
        q, k, v = (seq_to_heads(t.transpose(1, 2), group).transpose(1, 2) for t in (query, key, value))
        kwargs.pop("is_causal", None)

        def attend() -> tuple[torch.Tensor, Any]:  # out: (b, s, H/C, hd)
            if window is not None:  # the whole sequence of H/C heads here: causal, in the window, by blocks
                return windowed_attention(q, k, v, kwargs.get("scaling"), window).transpose(1, 2), None
            if repeated:  # (the model's own attention would repeat them again by its num_key_value_groups)
                out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=kwargs.get("dropout", 0.0),
                                                                 is_causal=True, scale=kwargs.get("scaling"))
                return out.transpose(1, 2), None
            return inner(module, q, k, v, None, is_causal=True, **kwargs)
        return output_exchanged(group, attend)
    return attention


def ring_hf_attention(group: DataParallelGroup) -> Callable[..., Any]:
    """An attention function (Transformers' signature) running ring attention on this rank's zigzag tokens."""
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        window = binding(check_attention_call(module, kwargs, "ring", dropout_ok=False), query.shape[2] * group.size)
        repeat = query.shape[1] // key.shape[1]  # grouped-query attention: query head i reads key head i // repeat
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        return ring_attention(query, key, value, group, scaling, window=window).transpose(1, 2), None
    return attention


def hybrid_hf_attention(ulysses: DataParallelGroup, ring: DataParallelGroup) -> Callable[..., Any]:
    """An attention function (Transformers' signature) for ``context_mode: "hybrid"``: this rank's tokens of
    all heads to the ring rank's zigzag tokens of 1/U of the heads (Ulysses), ring attention over the ring,
    and back. Grouped-query K and V are repeated to one per query head first (the ring needs them so)."""
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        window = binding(check_attention_call(module, kwargs, "hybrid", dropout_ok=False),
                         query.shape[2] * ulysses.size * ring.size)
        repeat = query.shape[1] // key.shape[1]
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        q, k, v = (seq_to_heads(t.transpose(1, 2), ulysses).transpose(1, 2) for t in (query, key, value))

        def attend() -> tuple[torch.Tensor, None]:
            return ring_attention(q, k, v, ring, scaling, window=window).transpose(1, 2), None
        return output_exchanged(ulysses, attend)  # (the ring's saved output formed again from the home copy)
    return attention


def _whole_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None) -> torch.Tensor:
    """The positions 0 .. s-1 of every whole sequence, after refusing what the split attention cannot honour: a
    custom or padding attention mask, and position ids that restart (packed sequences)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"context parallelism: a custom attention mask of shape {tuple(attention_mask.shape)} is "
                         f"not supported (the split attention is causal over the whole sequence)")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("context parallelism: padded sequences (attention_mask with zeros) are not supported")
    b, s = input_ids.shape
    plain = torch.arange(s, device=input_ids.device).expand(b, s)
    if position_ids is not None and not torch.equal(position_ids.expand(b, s), plain):
        raise ValueError("context parallelism: position_ids other than 0 .. s-1 in every row (packed sequences, "
                         "whose positions restart) are not supported: the split attention would let a sequence "
                         "attend to the one packed before it")
    return plain


def context_parallel_hf(model: nn.Module, group: DataParallelGroup, mode: str = "ulysses",
                        parts: tuple[DataParallelGroup, DataParallelGroup] | None = None) -> None:
    """Give a Hugging Face causal LM instance context parallelism over ``group`` (module docstring);
    ``mode``: "ulysses", "ring" or "hybrid" (``parts``: the Ulysses group and the ring, ``groups.py``)."""
    if transformers is None:
        raise ValueError("context parallelism for a Hugging Face model needs the transformers package")
    config: Any = getattr(model, "config")
    ring = mode == "ring"
    if mode == "hybrid" and parts is None:
        raise ValueError("context_mode 'hybrid' needs the Ulysses group and the ring (parts)")
    if mode == "ulysses":
        check_heads(int(config.num_attention_heads), group)
    inner = transformers.AttentionInterface._global_mapping.get(config._attn_implementation)
    if inner is None:
        inner = transformers.integrations.sdpa_attention.sdpa_attention_forward  # eager and unknown: sdpa's math
    name = f"{NAME}_{id(model)}"
    split: Callable[..., torch.Tensor] = zigzag_slice if ring else local_slice
    if parts is not None and mode == "hybrid":
        ug, rg = parts
        check_heads(int(config.num_attention_heads), ug)
        attention = hybrid_hf_attention(ug, rg)

        def split(x: torch.Tensor, _: DataParallelGroup) -> torch.Tensor:  # ring's zigzag, then the 1/U slice
            return local_slice(zigzag_slice(x, rg), ug)
    else:
        attention = ring_hf_attention(group) if ring else ulysses_attention(inner, group)
    transformers.AttentionInterface.register(name, attention)
    config._attn_implementation = name
    original = model.forward

    def forward(self: nn.Module, input_ids: torch.Tensor | None = None, *args: Any, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if input_ids is None:
            raise ValueError("context parallelism: give input_ids (whole sequences; each rank keeps its slice)")
        position_ids = _whole_positions(input_ids, attention_mask, position_ids)
        if labels is not None:
            shift = kwargs.pop("shift_labels", None)
            whole = shifted(labels) if shift is None else shift
            items = kwargs.pop("num_items_in_batch", None)
            items = (whole != IGNORE_INDEX).sum() if items is None else items
            # each rank divides its tokens' sum by 1/C of the count: the engine's mean over the C ranks is then
            # the mean over every token, however the ignored ones fall
            kwargs["num_items_in_batch"] = items / group.size
            kwargs["shift_labels"] = split(whole, group).contiguous()  # (HF views it flat)
            labels = split(labels, group)
        return original(split(input_ids, group), *args, labels=labels, position_ids=split(position_ids, group),
                        **kwargs)

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


__all__ = ["context_parallel_hf", "hybrid_hf_attention", "ring_hf_attention", "ulysses_attention"]
