"""Tiled loss for a causal language model: the LM head and cross-entropy over tiles of tokens.

    tile_loss(model, 1024)    # zeroplus's GPT, or a Hugging Face *ForCausalLM (Llama, GPT-2, Qwen2, Mistral, ...)

From then on a forward with targets/labels never forms the ``(tokens, vocabulary)`` logits whole: the
head and the cross-entropy run over ``tiles`` of tokens in forward and again in backward
(``tiled.py``), so the loss costs ``t * V * 4 * 2`` bytes for a tile of ``t`` tokens instead of about
``N * V * 4 * 3`` (the logits, their fp32 copy and their gradient) for ``N`` tokens. A forward without
labels (inference, generation) is untouched.

Hugging Face models keep their own forward: while it runs, the model's ``lm_head`` is swapped for a
stand-in that records the final hidden states and returns a zero-stride placeholder as logits (no
memory); the loss is then computed from those hidden states with the real head, shifted exactly as
``ForCausalLMLoss`` shifts (or with the caller's ``shift_labels``), divided by ``num_items_in_batch``
when the trainer passes it, else by the number of counted tokens. The output's ``logits`` is None. A
mixture-of-experts model's router loss is added as its forward adds it with labels.
"""
from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .tiled import tiled_cross_entropy

IGNORE_INDEX = -100


class _RecordHidden(nn.Module):
    """Stands in for the LM head during a forward: keeps its input, returns logits of zero stride."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], self.vocab)


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """Tokens < n predict n: labels shifted left by one, the last position ignored."""
    return nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def tile_hf_causal_lm(model: nn.Module, tile_tokens: int) -> None:
    """Give a Hugging Face ``*ForCausalLM`` instance the tiled loss (module docstring)."""
    settings = vars(model)  # the tile size lives in the instance's dict: tiling again only changes it
    if "_zeroplus_loss_tiles" in settings:
        settings["_zeroplus_loss_tiles"] = int(tile_tokens)
        return
    original = model.forward

    def forward(self: nn.Module, *args: Any, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(*args, **kwargs)
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        head: nn.Module = getattr(self, "lm_head")
        config: Any = getattr(self, "config")
        recorder = _RecordHidden(int(config.vocab_size))
        setattr(self, "lm_head", recorder)
        try:
            out = original(*args, **kwargs)
        finally:
            setattr(self, "lm_head", head)
        if recorder.hidden is None:
            raise RuntimeError(f"zeroplus.tiled.loss_tokens: {type(self).__name__}'s forward did not call its lm_head")
        targets = shifted(labels) if shift_labels is None else shift_labels
        loss = tiled_cross_entropy(head, recorder.hidden, targets, vars(self)["_zeroplus_loss_tiles"], IGNORE_INDEX,
                                   num_items)
        aux = out.get("aux_loss") if hasattr(out, "get") else None
        if aux is not None:  # a mixture of experts: its forward adds the router loss when given labels
            loss = loss + getattr(self, "router_aux_loss_coef") * aux.to(loss.device)
        out["loss"] = loss
        out["logits"] = None
        return out

    settings["_zeroplus_loss_tiles"] = int(tile_tokens)
    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


def is_hf_causal_lm(model: nn.Module) -> bool:
    return (isinstance(getattr(model, "lm_head", None), nn.Module) and hasattr(model, "loss_function")
            and hasattr(getattr(model, "config", None), "vocab_size"))


def tile_loss(model: nn.Module, tile_tokens: int) -> None:
    """Tile ``model``'s loss: zeroplus's GPT (its ``config.loss_tile_tokens``) or a Hugging Face causal LM;
    anything else is refused, naming its class."""
    config: Any = getattr(model, "config", None)
    if hasattr(config, "loss_tile_tokens"):
        config.loss_tile_tokens = int(tile_tokens)
    elif is_hf_causal_lm(model):
        tile_hf_causal_lm(model, tile_tokens)
    else:
        raise ValueError(f"{type(model).__name__} is neither zeroplus's GPT nor a Hugging Face causal LM (an "
                         f"lm_head and a loss_function): tile its loss with zeroplus.activations.tiled_cross_entropy "
                         f"in its forward instead")


__all__ = ["IGNORE_INDEX", "is_hf_causal_lm", "shifted", "tile_hf_causal_lm", "tile_loss"]
