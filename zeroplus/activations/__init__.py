"""Activation memory techniques: resize-based recompute, swap to a lower tier, checkpointing.

``saved_tensors.py`` routes every tensor autograd saves during the engine's forward to the
technique that claims it; the techniques themselves live one per file.
"""
from .resize_recompute import ResizeRecompute
from .saved_tensors import SavedTensorRouter
from .swap import SwapAttention

__all__ = ["ResizeRecompute", "SavedTensorRouter", "SwapAttention"]
