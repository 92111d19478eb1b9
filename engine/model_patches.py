"""What ``initialize`` changes on the model besides hooks, recorded before and given back by ``destroy``.

The memory techniques and the parallel layouts replace forwards on module instances (fused operators,
tiled MLPs and losses, a Hugging Face model's context-parallel forward and its training forward without the KV
cache) and set attributes (the tile sizes, the training cache's flag, zeroplus's GPT's ``config.loss_tile_tokens``,
a Hugging Face config's attention implementation).
``remember(model)`` notes each of these as it is (or its absence) on every module; the callable it returns
puts them back, so a model initialized again with other settings runs as built. Memory: a few references per
module.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

_INSTANCE = ("forward", "_zeroplus_tiled", "_zeroplus_loss_tiles", "_zeroplus_no_training_cache")  # on the instances
_CONFIG = ("loss_tile_tokens", "_attn_implementation")  # set on a model's config
_ABSENT = object()


def remember(model: torch.nn.Module) -> Callable[[], None]:
    """A callable that gives every module of ``model`` back the instance attributes and config settings
    above as they are now."""
    modules = [(m, {k: vars(m).get(k, _ABSENT) for k in _INSTANCE}) for m in model.modules()]
    configs = [(c, {k: getattr(c, k, _ABSENT) for k in _CONFIG}) for c in _configs(model)]

    def give_back() -> None:
        for module, kept in modules:
            for key, value in kept.items():
                if value is _ABSENT:
                    vars(module).pop(key, None)
                else:
                    vars(module)[key] = value
        for config, kept in configs:
            for key, value in kept.items():
                if value is not _ABSENT and getattr(config, key, _ABSENT) != value:
                    setattr(config, key, value)
    return give_back


def _configs(model: torch.nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and not isinstance(config, torch.nn.Module):
            seen.setdefault(id(config), config)
    return list(seen.values())


__all__ = ["remember"]
