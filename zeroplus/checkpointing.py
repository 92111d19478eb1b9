"""``zeroplus.checkpointing``: activation checkpointing under DeepSpeed's name (``deepspeed.checkpointing``).

The mechanism is ``zeroplus/activations/checkpointing.py``, beside the other activation techniques;
training checkpoints (save, load, export) are ``engine/checkpoints/`` (``zeroplus.engine.checkpoints``).
See note: names (docs/design-notes.md).
"""
from .activations.checkpointing import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
