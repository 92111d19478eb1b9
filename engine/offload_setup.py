"""Where the model states go off the device, as the config asks.

``zero_optimization.offload_param``, ``offload_optimizer`` and ``zeroplus.virtual_optimizer_states``: each request
checked against the stage and the machine (refused naming its key and rank), its tier made (host memory or files
with the space they need checked first) and the policy the partition or the step follows returned; None where the
config asks for nothing. Used by ``build.build_engine``; see ``offload/`` for the tiers themselves.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from zeroplus.accelerator import Accelerator
from zeroplus.config import ConfigError, ResolvedConfig
from zeroplus.ledger import Ledger
from zeroplus.logs import log_rank0
from zeroplus.offload import virtual_host
from zeroplus.offload.disk_space import check_free_space, state_bytes_per_element
from zeroplus.offload.policies import OptimizerStateOffload, ParamOffload
from zeroplus.offload.tiers import make_tier


def offload_tier(key: str, block: Any, accel: Accelerator, ledger: Ledger, needed: int, direct: bool) -> Any:
    """The tier of ``zero_optimization.<key>``; for files, ``needed`` bytes must be free in its path."""
    try:
        tier = make_tier("file" if block.device == "nvme" else "host", block.nvme_path, accel, ledger,
                         label=key.replace("offload_", ""), direct=direct, create=False)
        if block.device == "nvme" and tier.directory is not None:  # (None: the estimator's meta tier)
            check_free_space(tier.directory, needed)
    except (ValueError, OSError) as err:
        raise ConfigError(f"config key 'zero_optimization.{key}.nvme_path' ({block.nvme_path!r}) on rank "
                          f"{dist.get_rank() if dist.is_initialized() else 0}: {err}") from None
    if not tier.saves_memory:
        log_rank0("%s.device=cpu: host memory is this machine's only memory (no accelerator), so nothing moves; "
                  "device 'nvme' with an nvme_path keeps it in files", key, level=logging.WARNING)
    return tier


def param_offload_of(cfg: ResolvedConfig, model: torch.nn.Module, group_of: dict[int, int], world: int,
                   accel: Accelerator, ledger: Ledger) -> ParamOffload | None:
    """``zero_optimization.offload_param``: the tier that keeps the stage-3 master shards."""
    zero = cfg.zero_optimization
    block = zero.offload_param
    if block is None or not zero.offloads_params:
        return None
    if not zero.stage.shards_parameters:
        raise ConfigError(f"config key 'zero_optimization.offload_param' needs ZeRO stage 3 (stage is {zero.stage}); "
                          f"at stages 1 and 2 every rank holds all parameters for compute")
    owned = sum(p.numel() for p in model.parameters() if id(p) in group_of) // world + 1
    tier = offload_tier("offload_param", block, accel, ledger, 4 * owned, cfg.zeroplus.direct_io)
    log_rank0("parameter shards (fp32 masters) offloaded to %s, read one unit ahead of each gather", block.device)
    return ParamOffload(tier, block.buffer_count)


def virtual_states(cfg: ResolvedConfig, accel: Accelerator, opt: torch.optim.Optimizer) -> Any:
    """``zeroplus.virtual_optimizer_states``: the NPU kernels, or None when off; refused where they cannot run."""
    if not cfg.zeroplus.virtual_optimizer_states:
        return None
    key = "config key 'zeroplus.virtual_optimizer_states'"
    kernels = virtual_host.npu_kernels()
    if kernels is None or (accel.name != "npu" and virtual_host.CPU_TWIN is None):
        raise ConfigError(f"{key} needs an Ascend NPU whose torch_npu has empty_with_swapped_memory and "
                          f"npu_apply_adam_w (this machine's accelerator: {accel.name}); on other machines "
                          f"zero_optimization.offload_optimizer moves the states instead")
    zero = cfg.zero_optimization
    clashes = [name for name, on in [
        ("zero_optimization.offload_optimizer", zero.offloads_optimizer),
        ("zero_optimization.offload_param", zero.offloads_params),
        ("zeroplus.shared_master_weights", cfg.zeroplus.shared_master_weights)] if on]
    if clashes:
        raise ConfigError(f"{key} steps a whole fp32 master in place, so it does not combine with {clashes}")
    try:
        virtual_host.check_optimizer(opt)
    except ValueError as err:
        raise ConfigError(f"{key} {err}") from None
    log_rank0("optimizer states in host memory mapped into the device (empty_with_swapped_memory)")
    return kernels


def optimizer_offload(cfg: ResolvedConfig, accel: Accelerator, ledger: Ledger, opt: torch.optim.Optimizer,
                       owned: int) -> OptimizerStateOffload | None:
    """``zero_optimization.offload_optimizer``: the tier and window for the optimizer states."""
    zero = cfg.zero_optimization
    block = zero.offload_optimizer
    if block is None or not zero.offloads_optimizer:
        return None
    if not zero.stage.partitions:
        raise ConfigError("config key 'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (stage is 0)")
    tier = offload_tier("offload_optimizer", block, accel, ledger,
                         int(state_bytes_per_element(opt) * owned * block.ratio), cfg.zeroplus.direct_io)
    log_rank0("optimizer states offloaded to %s: sub-groups of %d elements, ratio %.2f, window %d",
              block.device, zero.sub_group_size, block.ratio, block.buffer_count)
    return OptimizerStateOffload(tier, zero.sub_group_size, block.ratio, block.buffer_count)
