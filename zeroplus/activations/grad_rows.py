"""Gradients by rows: a 2-D parameter's gradient handed on a block of rows at a time, as it is made.

    offer_rows(param, sink)          # the engine: where param's gradient rows go (kept alive by the caller)
    sink = rows_sink(param)          # a function making param's gradient by rows (the tiled loss's head)
    sink(start, rows, last)          # rows start..start+len(rows) of this backward's gradient; last: all made

A function whose backward makes a 2-D parameter's gradient in slices of rows (``linear_cross_entropy.py``:
the LM head's gradient one vocabulary slice at a time) hands each slice to the parameter's sink when the
engine offered one, and returns no gradient for it: the engine adds the slice straight into its flat
gradient buffer (``zeroplus.zero.partition``), so the parameter's whole gradient never exists beside
that buffer. Without a sink the function forms the whole gradient itself and returns it.

Memory: ``c * V * d`` bytes fewer during that backward for a ``(V, d)`` parameter of ``c``-byte gradients
(4 V d in fp32; an LM head of a 128k vocabulary and d 4096: 2 GiB), for ``s * d`` per slice of ``s`` rows.

The registry holds weak references only (to the parameter and to the sink): a sink lives as long as
whatever offered it (the partition), and a parameter's entry goes with it.
"""
from __future__ import annotations

import weakref
from typing import Protocol

import torch


class RowsSink(Protocol):
    def __call__(self, start: int, rows: torch.Tensor, last: bool) -> None: ...


_SINKS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _forget(key: int) -> None:
    _SINKS.pop(key, None)


def offer_rows(param: torch.Tensor, sink: RowsSink) -> None:
    """From now on ``rows_sink(param)`` is ``sink`` (weakly held: the caller keeps it alive), replacing any
    earlier one."""
    key = id(param)
    _SINKS[key] = (weakref.ref(param, lambda _: _forget(key)), weakref.ref(sink))


def rows_sink(param: torch.Tensor) -> RowsSink | None:
    """The sink offered for ``param`` if it and its offerer are alive, else None."""
    entry = _SINKS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


__all__ = ["RowsSink", "offer_rows", "rows_sink"]
