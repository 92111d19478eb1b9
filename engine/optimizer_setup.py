"""The optimizer over the master shards and its schedule, as the engine assembles them (``engine/build.py``).

The config's optimizer block builds one (``optim/build.py``), its moments stored in the dtypes
``zeroplus.optimizer_states`` or ``bf16.bf16_optimizer_states`` ask for (``optim/stored_states.py``); a client's is
re-pointed at the shards. What cannot be assembled is refused on every rank before anything moves: both an optimizer
and an optimizer block, an optimizer zeroplus does not know to update element by element, stored state dtypes with
the optimizer states in virtual host memory (whose kernel steps fp32 states only), or a client optimizer other
than torch's Adam and AdamW (a client's Adam or AdamW is made its stored-states counterpart in place:
``stored_states.adopt``).
"""
from __future__ import annotations

from typing import Any

import torch

from zeroplus.config import ConfigError, ResolvedConfig, ZeroplusConfig
from zeroplus.optim.build import (
    adopt_client_optimizer,
    build_optimizer,
    check_elementwise,
    resolve_optimizer_class,
    would_fuse,
)
from zeroplus.optim.forward_only import ForwardOnly
from zeroplus.optim.muon import muon_kwargs, takes_muon
from zeroplus.optim.schedulers import build_scheduler
from zeroplus.optim.stored_states import adopt, adoptable, requested
from zeroplus.zero import ZeroPartition
from zeroplus.zero.use_grads import lookup


def stored_states(cfg: ZeroplusConfig) -> dict[str, Any] | None:
    """The stored-states arguments the config asks for (None: fp32 moments, torch's own optimizer)."""
    block = cfg.zeroplus.optimizer_states
    try:
        return requested(block.exp_avg, block.exp_avg_sq, block.rounding, cfg.bf16.bf16_optimizer_states,
                         block.block)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def masters_in_bf16(cfg: ZeroplusConfig) -> bool:
    """Whether the config asks for bf16 master weights: ``zeroplus.master_weights.dtype``, unset: DeepSpeed's
    ``bf16.bf16_master_weights_and_grads``."""
    dtype = cfg.zeroplus.master_weights.dtype
    return (dtype or ("bf16" if cfg.bf16.bf16_master_weights_and_grads else "fp32")) == "bf16"


def muon_params(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters the config's Muon steps (the rest: AdamW). A parameter's own ``use_muon`` attribute
    decides where set (DeepSpeed's tag, set by the user); else DeepSpeed's rule (matrices, not named ``embed`` or
    ``lm_head``: ``optim/muon.takes_muon``), and not a table the model looks rows up in, by what its module computes
    (``zero/use_grads.lookup``: a GPT's ``wte`` and ``wpe`` are embeddings whatever their names)."""
    chosen: dict[int, bool] = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in chosen and not chosen[id(p)]:
                continue  # (a tied parameter: an embedding wherever one of its modules looks rows up)
            full = f"{module_name}.{name}" if module_name else name
            tagged = getattr(p, "use_muon", None)
            chosen[id(p)] = (bool(tagged) if tagged is not None
                             else takes_muon(full, p) and lookup(module, name) is None)
    return {pid for pid, on in chosen.items() if on}


def check_optimizer_request(cfg: ResolvedConfig, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                            rank: int) -> None:
    """Refuse an optimizer request that cannot be assembled, naming the key and the rank."""
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' block; "
                          "give one or the other")
    try:  # (before anything moves: the model is left as it was)
        if optimizer is not None:
            check_elementwise(type(optimizer), cfg.zeroplus.elementwise_optimizer, "the client optimizer")
        elif cfg.optimizer is not None:
            given = f"config key 'optimizer.type' ({cfg.optimizer.type!r}):"
            check_elementwise(resolve_optimizer_class(cfg.optimizer.type, dict(cfg.optimizer.params)),
                              cfg.zeroplus.elementwise_optimizer, given)
    except ValueError as err:
        raise ConfigError(f"rank {rank}: {err}") from None
    if optimizer is None and cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":
        _check_muon(cfg, rank)
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("an lr_scheduler was passed to initialize() and the config has a 'scheduler' block; "
                          "give one or the other")
    try:
        states = stored_states(cfg)
    except ConfigError as err:
        raise ConfigError(f"rank {rank}: {err}") from None
    if states is None or (optimizer is None and cfg.optimizer is None):
        return
    what = (f"rank {rank}: config key 'zeroplus.optimizer_states' (or 'bf16.bf16_optimizer_states') asks for "
            f"moments in {states['exp_avg_dtype']} and {states['exp_avg_sq_dtype']}")
    if optimizer is not None:
        try:
            adoptable(optimizer)
        except ValueError as err:
            raise ConfigError(f"{what}; the client optimizer {type(optimizer).__name__}: {err}") from None
    if cfg.zeroplus.virtual_optimizer_states:
        raise ConfigError(f"{what}, and the optimizer states are in virtual host memory "
                          f"(zeroplus.virtual_optimizer_states), whose NPU kernel steps fp32 states only")
    if optimizer is not None:
        return
    assert cfg.optimizer is not None
    try:
        build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), [{"params": [torch.zeros(1)]}], False,
                        states)
    except ValueError as err:
        raise ConfigError(f"rank {rank}: {err}") from None


def _check_muon(cfg: ResolvedConfig, rank: int) -> None:
    """Muon orthogonalizes whole matrices from a resident fp32 master stepped whole (``optim/muon.py``): refused where
    the master or its states live elsewhere, or where a matrix is split over tensor ranks."""
    zero = cfg.zero_optimization
    refused = [("zero_optimization.offload_optimizer", zero.offloads_optimizer),
               ("zero_optimization.offload_param", zero.offloads_params),
               ("zeroplus.virtual_optimizer_states", cfg.zeroplus.virtual_optimizer_states),
               ("zeroplus.shared_master_weights", cfg.zeroplus.shared_master_weights is True),
               ("zeroplus.master_weights (bf16)", masters_in_bf16(cfg)),
               ("zeroplus.parallel.tensor", cfg.zeroplus.parallel.tensor > 1)]
    for key, on in refused:
        if on:
            raise ConfigError(f"rank {rank}: config key 'optimizer.type' is 'Muon' and '{key}' is set: Muon "
                              f"orthogonalizes each whole matrix from a resident fp32 master stepped whole, which "
                              f"that setting splits or moves; not supported with Muon yet")
    try:
        muon_kwargs(dict(cfg.optimizer.params) if cfg.optimizer is not None else {}, False)
    except ValueError as err:
        raise ConfigError(f"rank {rank}: {err}") from None


def optimizer_and_schedule(cfg: ResolvedConfig, partition: ZeroPartition, groups: list[dict[str, Any]],
                            optimizer: torch.optim.Optimizer | None, lr_scheduler: Any,
                            simulated: Any) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over the master shards (the client's, re-pointed, or the config's) and its schedule."""
    masters = [[g.master_param for g in partition.groups if g.group_index == gi] for gi in range(len(groups))]
    if not groups:
        return ForwardOnly(), lr_scheduler
    if optimizer is not None:
        opt = adopt_client_optimizer(optimizer, masters)
        states = stored_states(cfg)
        if states is not None:  # (checked: check_optimizer_request)
            opt = adopt(opt, states)
    else:
        assert cfg.optimizer is not None
        opt_groups = [dict({k: v for k, v in g.items() if k != "params"}, params=m) for g, m in zip(groups, masters)]
        opt = build_optimizer(cfg.optimizer.type, dict(cfg.optimizer.params), opt_groups,
                              cfg.zeroplus.fused_optimizer and simulated is None,  # meta has no fused kernels
                              stored_states(cfg))
        if simulated is not None and would_fuse(cfg.optimizer.type, dict(cfg.optimizer.params),
                                                cfg.zeroplus.fused_optimizer):
            opt.step = simulated.fused(opt)  # type: ignore[method-assign]
    if cfg.scheduler is not None:
        scheduler = build_scheduler(cfg.scheduler.type, dict(cfg.scheduler.params), opt)
    elif lr_scheduler is not None and callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        scheduler = lr_scheduler(opt)
    else:
        scheduler = lr_scheduler
    stepped_by_chunks = [key for key, on in [("zeroplus.shared_master_weights", cfg.zeroplus.shared_master_weights),
                                             ("zeroplus.master_weights", masters_in_bf16(cfg))] if on]
    if stepped_by_chunks and any(opt.state.get(m) for ms in masters for m in ms):
        raise ConfigError(f"config key '{stepped_by_chunks[0]}' keeps masters the optimizer steps chunk by chunk, but "
                          f"{type(opt).__name__} creates its states when constructed; use an optimizer that creates "
                          f"them in its first step")
    return opt, scheduler
