"""Reading and writing stage-3 frozen parameters whole, for checkpoints and exports.

A frozen group (``flat_group.py``: frozen groups) keeps only this rank's shard. ``read_frozen`` gathers
one frozen group at a time (an all-gather over the data group: every rank calls it), hands each of its
parameters to ``keep`` on the ranks that ask, and frees the buffer again unless the engine had it
gathered. ``write_frozen`` writes a whole parameter's values into this rank's shard (and into the
gathered buffer when it is gathered). Memory: one frozen group gathered, plus what ``keep`` keeps.
"""
from __future__ import annotations

from typing import Callable

import torch

from .flat_group import FlatParamGroup


def read_frozen(groups: list[FlatParamGroup], keep: Callable[[str, torch.Tensor], None] | None) -> None:
    """Every rank calls it; ``keep(name, values)`` (None on ranks that keep nothing) sees each frozen
    parameter whole, in the compute dtype, while its group is gathered."""
    for g in groups:
        held = g.gathered
        if held:  # the engine's (a prefetch may be in flight): let it land
            g.unit.wait_handles()
        else:
            handle = g.gather()
            if handle is not None:
                handle.wait()
            g.expose()
        if keep is not None:
            for name, p in zip(g.names, g.params):
                keep(name, p.detach())
        if not held:
            g.release()


def write_frozen(g: FlatParamGroup, index: int, values: torch.Tensor) -> None:
    """Write parameter ``index`` of frozen group ``g`` (``values`` whole, its shape) into this rank's shard."""
    off, n = g.offsets[index], g.numels[index]
    flat = values.reshape(-1)
    lo, hi = g.owned_start, g.owned_start + g.owned_numel
    start, end = max(off, lo), min(off + n, hi)
    with torch.no_grad():
        if start < end:
            g.master_store.write(start - lo, flat[start - off:end - off])
        if g.gathered:
            g._full_data[off:off + n].copy_(flat)
