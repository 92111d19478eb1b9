"""Ulysses attention keeps one copy of its output for backward, not two.

Under Ulysses, attention's output is formed in the head layout ``(b, s, H/C, hd)`` and the all-to-all
``heads_to_seq`` brings it home as ``(b, s/C, H, hd)``. Autograd then holds both until backward: the
attention kernel saves its own output (SDPA's flash and efficient kernels need it for
``rowsum(dO * O)``) and the output projection saves the exchanged copy as its input. In one process
they are one storage; under Ulysses they are two, the same ``b * s * H * hd / C`` elements each, one
more activation of ``s/C`` tokens per attention layer than an exact 1/C split.

``output_exchanged(group, attend)`` runs ``attend`` (which returns the head-layout output) with
saved-tensor hooks that only record what autograd saves, brings the output home, and then replaces
every saved tensor that is a view of the head-layout output's storage by a recipe: in backward the
home copy goes through the inverse all-to-all again (``seq_to_heads``, a permutation, so the bits are
the same) and the saved view is taken of that. The head-layout output is then freed when the caller
drops it.

Memory: ``b * s * H * hd / C`` elements less per attention layer and micro-batch until backward; in
backward one such tensor at a time, formed when the attention's backward starts and freed when it
ends. Communication: one more all-to-all of that size per layer in backward (five instead of four).

It stands aside (everything saved as usual) when other saved-tensor hooks are active (the engine's
swap attention, a ``torch.utils.checkpoint`` region: they decide what is saved; not resize recompute's alone,
which only claims less under it),
when grad is off, for one rank, and when the output does not cover its storage contiguously. The home
copy's version is checked when the output is formed again, and every other saved tensor's when it is
given back (autograd checks none through hooks): modified in place meanwhile, backward raises
instead of using other values.
See note: one output copy (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..comm import DataParallelGroup
from .context import heads_to_seq, seq_to_heads_plain


class _HeadOutput:
    """The head-layout output formed again from its home copy, once per backward use."""

    def __init__(self, home: torch.Tensor, group: DataParallelGroup) -> None:
        self.home, self.group, self.version = home, group, home._version

    def form(self) -> torch.Tensor:
        if self.home._version != self.version:
            raise RuntimeError("Ulysses attention: its output was modified in place after the all-to-all; the "
                               "copy attention saved for backward cannot be formed again from it")
        return seq_to_heads_plain(self.home, self.group)


class _Saved:
    """One tensor autograd saved inside attention: the tensor itself, or a view of the re-formed output."""

    __slots__ = ("tensor", "version", "source", "view")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor.detach()  # (an alias: no cycle through an output's grad_fn)
        self.version = tensor._version
        self.source: _HeadOutput | None = None
        self.view: tuple[Any, ...] = ()

    def get(self) -> torch.Tensor:
        if self.tensor is not None:
            if self.tensor._version != self.version:  # (autograd checks no versions through hooks: we do)
                raise RuntimeError(f"Ulysses attention: a tensor of shape {tuple(self.tensor.shape)} it saved for "
                                   f"backward was modified in place after the forward")
            return self.tensor
        assert self.source is not None
        return self.source.form().as_strided(*self.view)


def _pack(records: list[_Saved]) -> Callable[[torch.Tensor], _Saved]:
    def pack(tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        records.append(saved)
        return saved
    return pack


def _unpack(saved: _Saved) -> torch.Tensor:
    return saved.get()


def _covers_storage(t: torch.Tensor) -> bool:
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _yields(top: Any) -> bool:
    """Whether the saved-tensor hooks on top (``None``: none) let this mechanism's own run inside them: the
    engine's router does when resize recompute is its only claimer (see note: hook scope). Asked only with
    more than one rank (a call TorchDynamo cannot trace, inside compiled blocks)."""
    return top is None or getattr(getattr(top[0], "__self__", None), "lets_inner_hooks", False)


def output_exchanged(group: DataParallelGroup,
                     attend: Callable[[], tuple[torch.Tensor, Any]]) -> tuple[torch.Tensor, Any]:
    """Run ``attend`` (returning the head-layout output ``(b, s, H/C, hd)`` and anything else), and return the
    output brought home ``(b, s/C, H, hd)`` with the rest; attention's saved copy of its output is then
    formed again from the home copy in backward (module docstring)."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # (private: absent, stand aside)
    hooked = group.size > 1 and torch.is_grad_enabled() and top_hooks is not None and _yields(top_hooks(False))
    if not hooked:
        out, rest = attend()
        return heads_to_seq(out, group), rest
    records: list[_Saved] = []
    with torch.autograd.graph.saved_tensors_hooks(_pack(records), _unpack):
        out, rest = attend()
    home = heads_to_seq(out, group)
    if _covers_storage(out):
        storage = out.untyped_storage()._cdata  # (the storage's identity; data pointers are all 0 on meta)
        source = _HeadOutput(home.detach(), group)
        for saved in records:
            t = saved.tensor
            if t is not None and t.untyped_storage()._cdata == storage and t.dtype == out.dtype:
                saved.view = (t.size(), t.stride(), t.storage_offset())
                saved.source, saved.tensor = source, None
    return home, rest


__all__ = ["output_exchanged"]
