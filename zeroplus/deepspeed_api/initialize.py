"""``deepspeed.initialize``: DeepSpeed's entry point, returning zeroplus's engine in DeepSpeed's shape.

Where the config comes from, as in DeepSpeed: ``config`` (or its older name ``config_params``), else
``args.deepspeed_config`` (``add_config_arguments``); both at once is an error. The Trainer and
Accelerate have filled its ``"auto"`` values by then; what is left unfilled is one error listing
every such key (``zeroplus/config/unresolved.py``). The optimizer may be a torch optimizer, a
callable taking the parameters (DeepSpeed's optimizer factory) or absent (the config's); the
schedule an object, a callable taking the optimizer, or absent. ``training_data`` gets a
``DataLoader`` of micro-batches over a ``DistributedSampler`` of the data-parallel group, shuffled with
its default seed as DeepSpeed's training loader is (so the same script sees the same batches).
Returns ``(engine, optimizer, dataloader, lr_scheduler)``.

``tp_model_init(model, tp_size, dtype, config)`` (what the Trainer calls before building its optimizer when the
config has ``tensor_parallel.autotp_size``) splits the model by its Hugging Face plan at once (AutoTP,
``zeroplus/parallel/autotp.py``), so the parameters the caller reads next are the slices ``initialize`` trains;
``initialize`` then finds the model split.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, DistributedSampler

from zeroplus.config import ConfigError
from zeroplus.initialize_engine import initialize as zeroplus_initialize
from zeroplus.initialize_engine import split_by_plans
from zeroplus.parallel.groups import ParallelGroups, init_parallel

from .engine import DeepSpeedEngine
from .unsupported import refuse


def _config_of(args: Any, config: Any, config_params: Any) -> dict[str, Any] | str:
    if config is not None and config_params is not None:
        raise ConfigError("deepspeed.initialize() was given both config= and config_params=; give one")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ConfigError(f"deepspeed.initialize() was given a config both as config= and as "
                          f"args.deepspeed_config ({from_args!r}); give one")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("deepspeed.initialize() needs a config: config= (a dict or JSON path) or "
                          "args.deepspeed_config (--deepspeed_config ds.json)")
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config)
    if hasattr(config, "to_dict") and not isinstance(config, dict):  # Accelerate's HfDeepSpeedConfig
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ConfigError(f"deepspeed.initialize(): the config must be a dict or a JSON path, got "
                          f"{type(config).__name__}")
    return config


def _raw_dict(config: dict[str, Any] | str) -> dict[str, Any]:
    """The config as the caller wrote it (``engine.config``), read once from a path."""
    if isinstance(config, dict):
        return config
    try:
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file '{config}' cannot be read: {err}") from None


def _dataloader(data: Any, engine: DeepSpeedEngine, collate_fn: Callable[..., Any] | None) -> DataLoader:
    dp = engine.engine.dp
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=dp.size, rank=dp.rank)
    return DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                      collate_fn=collate_fn, drop_last=engine.engine.config.dataloader_drop_last)


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepSpeedEngine, Any, DataLoader | None, Any]:
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if model is None:
        raise ValueError("deepspeed.initialize() needs model=")
    if mpu is not None:
        refuse("deepspeed.initialize(mpu=...)", "zeroplus builds its tensor/pipeline/expert groups from the "
               "config's 'zeroplus.parallel' block")
    if mesh_param is not None:
        refuse("deepspeed.initialize(mesh_param=...)", "use the config's 'zeroplus.parallel' block")
    if dist_init_required is False and not torch.distributed.is_initialized():
        raise RuntimeError("deepspeed.initialize(dist_init_required=False) but torch.distributed is not "
                           "initialised: initialise it first, or leave dist_init_required unset")
    source = _config_of(args, config, config_params)
    raw = copy.deepcopy(_raw_dict(source))
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = optimizer(params)
    _groups(raw)
    inner = zeroplus_initialize(model, raw, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                model_parameters=model_parameters)
    engine = DeepSpeedEngine(inner, raw)
    loader = _dataloader(training_data, engine, collate_fn) if training_data is not None else None
    return engine, engine.optimizer, loader, engine.lr_scheduler


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype | None = None, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """DeepSpeed's ``tp_model_init``: ``model`` split over ``tp_size`` tensor ranks by its Hugging Face plan, in
    place and now (the process groups made from ``config`` with that tensor size); the model is returned. The
    config's ``tensor_parallel.autotp_size``, where it gives one, must be ``tp_size``. ``dtype`` is the config's
    compute dtype (the engine casts at ``initialize``, as the config says)."""
    if kwargs:
        refuse(f"deepspeed.tp_model_init({', '.join(sorted(kwargs))}=...)",
               "zeroplus makes the tensor group from the config's sizes")
    raw: dict[str, Any] = copy.deepcopy(_raw_dict(_config_of(None, config, None))) if config is not None else {}
    given = raw.get("tensor_parallel", {}).get("autotp_size")
    if given is not None and given != tp_size:
        raise ConfigError(f"deepspeed.tp_model_init(tp_size={tp_size}) and the config's 'tensor_parallel.autotp_size' "
                          f"({given}) disagree; give one tensor-parallel size")
    raw.setdefault("tensor_parallel", {})["autotp_size"] = tp_size
    raw.setdefault("train_micro_batch_size_per_gpu", 1)  # (the groups need only the sizes)
    split_by_plans(model, _groups(raw))
    return model


def _groups(raw: dict[str, Any]) -> ParallelGroups:
    """The config's process groups, made anew where groups of another layout exist (as DeepSpeed makes each
    ``initialize``'s; an engine made before keeps its own)."""
    try:
        return init_parallel(raw, replace=True)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(f"config key 'zeroplus.parallel': {err}") from None
