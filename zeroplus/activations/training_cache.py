"""Hugging Face causal LMs keep no key/value cache while the engine trains them.

With ``config.use_cache`` true (the default in the Llama, Qwen2, Mistral, Mixtral and GPT-2 configs) a
Hugging Face model's forward builds a key/value cache in training too: the cache's first update
copies every layer's keys and values (``torch.cat``), attention then reads and saves the copies, and
the output carries them as ``past_key_values``, though nothing in training reads it. The engine's
model forward passes ``use_cache=False`` while the model is in training mode and the caller did not
pass ``use_cache`` (an explicit value, and evaluation, keep the model's own behaviour). Values are
unchanged.

Memory: at the peak of a forward and backward, nothing (the copies replace the originals attention
would have saved: 115.5 MiB saved for backward either way on a Llama of 4 layers, d 128, fp32, 2048
tokens); what it removes is a copy of every layer's K and V per step (and one layer's K and V twice
while its copy is made), and, while a caller keeps the output after backward, the
``2 * layers * kv_heads * head_dim`` elements per token its cache holds.
See note: no kv cache (docs/design-notes.md).
"""
from __future__ import annotations

import inspect
import types
from typing import Any

from torch import nn


def drop_training_cache(model: nn.Module) -> bool:
    """Make ``model``'s forward default to ``use_cache=False`` in training mode (once); False if its class's
    forward takes no ``use_cache``. The class's signature decides, not the instance's ``forward``: another
    wrapper (the tiled loss's, ``*args, **kwargs``) may already stand in front of it and pass it on."""
    settings = vars(model)
    if settings.get("_zeroplus_no_training_cache"):
        return True
    original = model.forward
    if "use_cache" not in inspect.signature(type(model).forward).parameters:
        return False

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.training and "use_cache" not in kwargs:
            kwargs["use_cache"] = False
        return original(*args, **kwargs)

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    settings["_zeroplus_no_training_cache"] = True
    return True


__all__ = ["drop_training_cache"]
