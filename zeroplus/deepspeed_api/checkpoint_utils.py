"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: copies that own their storage.

A tensor saved with ``torch.save`` writes its whole storage; a parameter that is a view of a flat
buffer would write the buffer. Accelerate clones a state dict this way before saving it.
Memory: one copy of every tensor in ``item``.
"""
from __future__ import annotations

from typing import Any

import torch

from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.checkpoint.utils")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


__all__ = ["clone_tensors_for_torch_save"]
