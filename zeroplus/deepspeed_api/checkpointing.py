"""``deepspeed.checkpointing`` (``deepspeed.runtime.activation_checkpointing.checkpointing``): zeroplus's
activation checkpointing (``zeroplus/activations/checkpointing.py``), with DeepSpeed's keyword names."""
from __future__ import annotations

from zeroplus.activations.checkpointing import checkpoint, configure, is_configured, reset

from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.checkpointing")

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
