"""A Hugging Face model split by its own plans for the layout the groups name: AutoTP over the tensor group
(``autotp.py``), AutoEP over the expert group (``autoep.py``); the one entry ``initialize``, DeepSpeed's
``tp_model_init`` and the memory estimate (on its meta copy, with the simulated rank's groups) split a model by.
With both sizes above 1, the experts modules go by the expert plan and the tensor plan's entries on them are left
out (the expert groups lie within one tensor rank's data ranks: each tensor rank runs its experts whole).
A ``ValueError`` names the key and the rank and leaves the model as it was; what it changed is returned (``Undo``).
"""
from __future__ import annotations

import torch

from .autoep import ep_plan, experts_modules, split_experts
from .autotp import Undo, split_by_plan, tp_plan
from .groups import ParallelGroups
from .moe import is_expert
from .tensor_layers import is_tensor_parallel


def by_plans(model: torch.nn.Module, tensor: int, expert: int) -> tuple[bool, bool]:
    """Whether a tensor size and an expert size would each split ``model`` by its own plans (the size above 1, the
    model has that plan and is not split that way by zeroplus's own layers already)."""
    params = list(model.parameters())
    return (tensor > 1 and tp_plan(model) is not None and not any(is_tensor_parallel(p) for p in params),
            expert > 1 and ep_plan(model) is not None and not any(is_expert(p) for p in params))


def splits(model: torch.nn.Module, parallel: ParallelGroups) -> bool:
    """Whether ``split_by_own_plans`` would split ``model`` (``by_plans`` of the groups' sizes, either)."""
    return any(by_plans(model, parallel.topology.tensor, parallel.topology.expert))


def split_by_own_plans(model: torch.nn.Module, parallel: ParallelGroups,
                       capacity_factor: float | None = None) -> Undo:
    top = parallel.topology
    tensor = (f"config key 'tensor_parallel.autotp_size' / 'zeroplus.parallel.tensor' is {top.tensor} "
              f"(rank {parallel.global_rank})")
    expert = (f"config key 'expert_parallel.autoep_size' / 'zeroplus.parallel.expert' is {top.expert} "
              f"(rank {parallel.global_rank})")
    modules = experts_modules(model)
    if top.tensor > 1 and top.expert > 1 and modules and top.experts_span_tensor:  # (each token T times: grads x T)
        raise ValueError(f"{tensor} and {expert} with 'zeroplus.parallel.experts_span_tensor': a Hugging Face "
                         f"mixture of experts split both ways draws its expert groups from one tensor rank's data "
                         f"ranks (the tensor ranks share their tokens, which would reach the experts {top.tensor} "
                         f"times); set experts_span_tensor false")
    cut = [n for n, m in modules for p in m.parameters(recurse=False) if is_tensor_parallel(p)]
    if top.expert > 1 and cut:
        raise ValueError(f"{expert}: {cut[0]}'s experts were split by tensor already (deepspeed.tp_model_init given "
                         f"no expert size: its config without 'expert_parallel'); give tp_model_init the config "
                         f"initialize gets, so the experts go by expert")
    leave = tuple(name for name, _ in modules) if top.expert > 1 else ()
    done = Undo()
    try:
        if top.tensor > 1:
            done = split_by_plan(model, parallel.tensor, tensor, leave)
        if top.expert > 1:
            split_experts(model, parallel.expert, expert, done, capacity_factor)
    except ValueError:
        done.undo()
        raise
    return done


__all__ = ["by_plans", "split_by_own_plans", "splits"]
