"""Reading stage-3 frozen parameters whole, for checkpoints and exports.

A frozen group (``flat_group.py``: frozen groups) keeps only this rank's shard. ``read_frozen`` gathers
one frozen group at a time (an all-gather over the data group: every rank calls it), copies each of its
parameters on the ranks that ask, and frees the buffer again unless the engine had it gathered.
(Writing goes through ``FlatParamGroup.write_param``, as for trained groups.) Memory: one frozen group
gathered, plus the copies.
"""
from __future__ import annotations

from typing import Callable

import torch

from .flat_group import FlatParamGroup


def read_frozen(groups: list[FlatParamGroup], copy: Callable[[torch.Tensor], torch.Tensor] | None
                ) -> dict[str, torch.Tensor]:
    """Every rank calls it; ``copy`` (None on ranks that keep nothing) copies each frozen parameter
    whole, in the compute dtype, while its group is gathered. Returns ``{name: copy}``."""
    out: dict[str, torch.Tensor] = {}
    for g in groups:
        held = g.gathered
        if held:  # the engine's (a prefetch may be in flight): let it land
            g.unit.wait_handles()
        else:
            handle = g.gather()
            if handle is not None:
                handle.wait()
            g.expose()
        if copy is not None:
            out.update({name: copy(p.detach()) for name, p in zip(g.names, g.params)})
        if not held:
            g.release()
    return out
