"""Model-state bytes per rank for any world size, from the engine's own partition code.

The model is built on the meta device (no memory), cast to the compute dtype, and partitioned by
``ZeroPartition`` exactly as ``initialize`` does, over a ``VirtualGroup``: a data-parallel group
of ``world_size`` ranks seen from ``rank``, with no process group behind it (its collectives do
nothing; the partition only needs sizes). The ledger then holds what that rank would allocate at
initialisation: ``param`` (low-precision parameters, stages 0-2), ``param_gathered`` (stage-3
units that stay gathered), ``master`` (fp32 masters, or bf16 shard plus residual when shared).
Optimizer states are added the way torch creates them in the first step: ``state_bytes_per_element``
of each group's owned length (``offload/disk_space.py``: 4 per fp32 state tensor, or what an optimizer storing its
moments in other dtypes says), under ``optim_state``.
With offload, what lives on a tier is reported apart: ``master_offloaded`` (``offload_param``,
stage 3) and ``optim_state_offloaded`` (``offload_optimizer``, by the engine's own sub-group plan
for ``ratio``); ``master`` and ``optim_state`` are then what stays on the device.

Cost: no parameter memory (meta tensors) and one pass over the modules; 1024 ranks cost what 2
do. Gradients, activations, buckets and windows are not model states and are not counted here.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..config import ZeroplusConfig, load_config, resolved_zero
from ..engine.build import compute_dtype, expert_split, make_partition
from ..engine.optimizer_setup import stored_states
from ..ledger import Category, Ledger
from ..offload.disk_space import state_bytes_per_element
from ..offload.optimizer_states import plan_sub_groups, scale_block
from ..optim.build import build_optimizer
from .virtual_parallel import build_in, virtual_groups


def model_state_bytes(build_model: Callable[[], torch.nn.Module], config: dict[str, Any] | str | ZeroplusConfig,
                      world_size: int, rank: int = 0) -> dict[str, int]:
    """Bytes per ledger category that ``rank`` of ``world_size`` holds in model states. With tensor,
    pipeline or expert parallelism in the config, the model is built as that rank builds it (its slice;
    ``virtual_parallel.py``) and partitioned over its data group (experts over its expert-data group; under MiCS, its
    shard group).

    ``build_model`` is called under ``torch.device("meta")``, so it must create its parameters on
    the current default device (the usual ``nn.Module`` constructors do).
    """
    cfg = load_config(config)
    dtype = compute_dtype(cfg)
    groups = virtual_groups(cfg, world_size, rank)  # with model parallelism: this rank's slice, its data group
    model = build_in(groups, build_model)
    if dtype != torch.float32:
        model.to(dtype)
    group_of = {id(p): 0 for p in model.parameters() if p.requires_grad}
    ledger = Ledger()
    partition = make_partition(model, cfg, groups.shard, ledger, dtype, group_of, None, expert_split(groups))
    out = {c.value: ledger.live_bytes(c) for c in (Category.PARAM, Category.PARAM_GATHERED, Category.MASTER)}
    zero = resolved_zero(cfg.zero_optimization)  # make_partition refused anything still 'auto'
    if zero.stage.shards_parameters and zero.offloads_params:
        out["master_offloaded"], out["master"] = out["master"], 0  # on the tier, not the device
    if cfg.optimizer is not None:
        masters = [g.master_param for g in partition.groups]
        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), [{"params": masters}], False,
                              stored_states(cfg))
        per_element = state_bytes_per_element(opt)
        exact = getattr(opt, "state_nbytes", None)  # stored states: bytes by tensor (fp8's scales by block)

        def nbytes(sizes: list[int]) -> int:
            return sum(exact(n) for n in sizes) if exact is not None else math.ceil(per_element * sum(sizes))
        owned = [g.owned_numel for g in partition.groups]
        kept = owned
        offload = zero.offload_optimizer
        if offload is not None and zero.offloads_optimizer and zero.stage.partitions:  # the engine's own sub-group plan
            plan = plan_sub_groups(owned, zero.sub_group_size, offload.ratio, scale_block(opt))
            kept = [b - a for chunks, resident in plan for a, b in chunks[:resident]]
            out["optim_state_offloaded"] = nbytes([b - a for chunks, resident in plan for a, b in chunks[resident:]])
        out[Category.OPTIM_STATE.value] = nbytes(kept)
    return out
