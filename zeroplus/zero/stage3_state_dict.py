"""Stage 3: ``state_dict()`` of the model (or of any of its modules) returns whole parameters.

Between forwards a stage-3 parameter holds an empty placeholder (``flat_group.py``; see note:
released parameters). A post-hook on every module that holds partitioned (trained or
frozen) parameters gathers the unit each of them lives in (an all-gather over the data group), stores a copy
of the parameter in the state dict, and frees the unit again unless it was gathered already. So
``state_dict()`` is a collective at stage 3: every rank calls it, as with FSDP's full state dict
(DeepSpeed returns empty placeholders instead). The values are the compute-dtype parameters, the
masters rounded (equal to them in fp32). Memory: the state dict's copies plus one unit gathered;
communication: each module's unit once per module that holds parameters directly.
"""
from __future__ import annotations

from typing import Any

import torch

from .units import Unit


def install_state_dict_hooks(model: torch.nn.Module, units: list[Unit]) -> list[Any]:
    """Hook every module of ``model`` that holds trainable parameters directly; returns the handles."""
    unit_of = {id(p): u for u in units for g in u.all_groups for p in g.params}
    handles = []
    for module in model.modules():
        direct = [(name, unit_of[id(p)]) for name, p in module.named_parameters(recurse=False, remove_duplicate=False)
                  if id(p) in unit_of]
        if direct:
            handles.append(module.register_state_dict_post_hook(_make_hook(direct)))
    return handles


def _make_hook(direct: list[tuple[str, Unit]]):
    by_unit: dict[int, tuple[Unit, list[str]]] = {}
    for name, unit in direct:
        by_unit.setdefault(id(unit), (unit, []))[1].append(name)

    def hook(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for unit, names in by_unit.values():
            held = all(g.gathered for g in unit.all_groups)  # (a prefetch in flight stays gathered)
            unit.wait_gather()
            for name in names:
                key = prefix + name
                if key in state_dict:  # what the module stored is the released placeholder: read it now
                    state_dict[key] = module._parameters[name].detach().clone()  # type: ignore[union-attr]
            if not held:
                unit.release()
    return hook
