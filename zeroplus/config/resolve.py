"""Turn a raw dict (or JSON path) into a validated, fully resolved ``ZeroplusConfig``.

Order: dotted keys read as the nested keys they name, strict key check (path + "did you mean"),
pydantic validation, then resolution of ``"auto"`` values and of the batch triple once the
data-parallel size is known. Every resolution is logged once on rank 0; a value that cannot be
derived is a ``ConfigError``.
"""
from __future__ import annotations

import collections
import copy
import json
import logging
import os
import re
from typing import Any

import torch
from pydantic import ValidationError

from .blocks import freeze
from .keys import ConfigError, check_keys, expand_dotted
from .model import ZeroplusConfig

logger = logging.getLogger("zeroplus.config")
SCHEDULER_KEYS_FROM_LR = ("warmup_max_lr", "cycle_max_lr")  # "auto": the optimizer's lr
SCHEDULER_KEYS_AT_ZERO = ("warmup_min_lr", "cycle_min_lr")  # "auto": 0
_TYPE_TAG = re.compile(r"^(int|float|bool|str|dict|list|none|literal\[.*\]|function-.*|constrained-.*)$")


def parse_config(config: dict[str, Any] | str | os.PathLike) -> tuple[ZeroplusConfig, list[str]]:
    """Validate keys and types; return the model and the DeepSpeed keys that are not implemented."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ConfigError(f"config file '{path}' does not exist")
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as err:
                raise ConfigError(f"config file '{path}' is not valid JSON: {err}") from None
    elif isinstance(config, dict):
        data = copy.deepcopy(config)
    else:
        raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    unimplemented: list[str] = []
    expand_dotted(data)
    check_keys(data, ZeroplusConfig, "", unimplemented)
    try:
        cfg = ZeroplusConfig.model_validate(data)
    except ValidationError as err:
        problems: dict[tuple[str, str], list[str]] = {}
        for e in err.errors():
            # Drop union-branch tags such as 'int' or "literal['auto']" from the location; one line
            # per key, its branches' messages joined ("less than or equal to 3 or 'auto'").
            where = ".".join(str(p) for p in e["loc"] if not _TYPE_TAG.match(str(p)))
            msgs = problems.setdefault((where, repr(e.get("input"))), [])
            if e["msg"] not in msgs:
                msgs.append(e["msg"])
        lines = [f"config key '{where}': {' or '.join(msgs)} (got {got})" for (where, got), msgs in problems.items()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None
    _merge_tensor_size(cfg)
    _merge_expert_size(cfg)
    return cfg, unimplemented


def load_config(config: ZeroplusConfig | dict[str, Any] | str | os.PathLike) -> ZeroplusConfig:
    """A config of one's own to resolve or change: a copy of a parsed one (a resolved one's copy thawed: see note:
    frozen config), or a dict or JSON path parsed."""
    if isinstance(config, ZeroplusConfig):
        return freeze(copy.deepcopy(config), False)  # type: ignore[return-value]
    return parse_config(config)[0]


def _merge_tensor_size(cfg: ZeroplusConfig) -> None:
    """DeepSpeed's ``tensor_parallel.autotp_size`` and ``zeroplus.parallel.tensor`` name one size."""
    ds, ours = cfg.tensor_parallel.autotp_size, cfg.zeroplus.parallel.tensor
    if ds == "auto":  # the planner's (zeroplus.parallel.tensor stays 1 until it chooses: budget/planner.py)
        if ours > 1:
            raise ConfigError(f"config key 'tensor_parallel.autotp_size' is 'auto' and 'zeroplus.parallel.tensor' is "
                              f"{ours}: give one tensor-parallel size, or 'auto' alone")
        return
    if ds > 1 and ours > 1 and ds != ours:
        raise ConfigError(f"config keys 'tensor_parallel.autotp_size' ({ds}) and 'zeroplus.parallel.tensor' ({ours}) "
                          f"disagree; give one tensor-parallel size")
    size = max(ds, ours)
    cfg.zeroplus.parallel.tensor = cfg.tensor_parallel.autotp_size = size


def _merge_expert_size(cfg: ZeroplusConfig) -> None:
    """DeepSpeed's ``expert_parallel.autoep_size`` (when ``enabled``) and ``zeroplus.parallel.expert`` name one
    size; a size DeepSpeed would not read (not enabled) is refused rather than ignored."""
    block, ours = cfg.expert_parallel, cfg.zeroplus.parallel.expert
    if block.autoep_size == "auto":  # the planner's (zeroplus.parallel.expert stays 1 until it chooses)
        if not block.enabled or ours > 1:
            raise ConfigError("config key 'expert_parallel.autoep_size' is 'auto' and " + (
                f"'zeroplus.parallel.expert' is {ours}: give one expert-parallel size, or 'auto' alone" if ours > 1
                else "'expert_parallel.enabled' is false: set enabled to true for expert parallelism"))
        return
    if block.autoep_size > 1 and not block.enabled:
        raise ConfigError(f"config key 'expert_parallel.autoep_size' is {block.autoep_size} and "
                          f"'expert_parallel.enabled' is false: set enabled to true for expert parallelism, or "
                          f"remove autoep_size")
    ds = block.autoep_size if block.enabled else 1
    if ds > 1 and ours > 1 and ds != ours:
        raise ConfigError(f"config keys 'expert_parallel.autoep_size' ({ds}) and 'zeroplus.parallel.expert' ({ours}) "
                          f"disagree; give one expert-parallel size")
    cfg.zeroplus.parallel.expert = max(ds, ours)


def resolve_batch(cfg: ZeroplusConfig, dp_size: int, tensor: int = 1) -> None:
    """Apply DeepSpeed's rule ``train_batch_size == micro * accumulation * dp_size``; derive the missing one.
    ``tensor``: the tensor size; all three given with ``train_batch_size`` counting the tensor ranks as data ranks
    (DeepSpeed's count under AutoTP without an mpu, and so the Trainer's fill of ``"auto"``) is read as the batch
    the data ranks see, and logged."""
    tbs, mbs, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    # "auto" is treated as "not given": DeepSpeed's rule derives it from the others.
    tbs, mbs, gas = (None if v == "auto" else v for v in (tbs, mbs, gas))
    if tensor > 1 and tbs is not None and mbs and gas and tbs != mbs * gas * dp_size \
            and tbs == mbs * gas * dp_size * tensor:
        logger.info("config: train_batch_size %s counts the %s tensor ranks as data ranks, as DeepSpeed's AutoTP "
                    "does; each step trains on %s samples (micro-batch x accumulation x data size %s)",
                    tbs, tensor, mbs * gas * dp_size, dp_size)
        tbs = mbs * gas * dp_size
    derived = []
    if tbs is not None and mbs is not None and gas is None:
        gas = tbs // (mbs * dp_size)
        derived.append("gradient_accumulation_steps")
    elif tbs is not None and gas is not None and mbs is None:
        mbs = tbs // (gas * dp_size)
        derived.append("train_micro_batch_size_per_gpu")
    elif mbs is not None and gas is not None and tbs is None:
        tbs = mbs * gas * dp_size
        derived.append("train_batch_size")
    elif tbs is not None and mbs is None and gas is None:
        gas, mbs = 1, tbs // dp_size
        derived += ["gradient_accumulation_steps", "train_micro_batch_size_per_gpu"]
    elif mbs is not None and tbs is None and gas is None:
        gas, tbs = 1, mbs * dp_size
        derived += ["gradient_accumulation_steps", "train_batch_size"]
    elif tbs is None and mbs is None and gas is None:
        raise ConfigError("the config must give train_batch_size or train_micro_batch_size_per_gpu")
    if not mbs or not gas or tbs != mbs * gas * dp_size:
        raise ConfigError(
            f"batch sizes do not fit: train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs}) "
            f"* gradient_accumulation_steps ({gas}) * data-parallel size ({dp_size})")
    for key in derived:
        logger.info("config: derived %s = %s", key, {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": mbs,
                                                    "gradient_accumulation_steps": gas}[key])
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = tbs, mbs, gas


def model_hidden_size(model: torch.nn.Module) -> int:
    """The model's hidden size, as Hugging Face's integration reads it for bucket sizes: its config's
    (``hidden_size``, ``d_model``, ``n_embd``, ``dim``, the largest of ``hidden_sizes``), else read from what the
    parameters are, whatever their modules' classes: the size their shapes share most (every dimension of every
    parameter counted once: a transformer's linears, norms and embeddings all carry its width), the larger on a
    tie."""
    conf = getattr(model, "config", None)
    for attr in ("hidden_size", "d_model", "n_embd", "dim"):
        value = getattr(conf, attr, None)
        if isinstance(value, int):
            return value
    sizes = getattr(conf, "hidden_sizes", None)
    if sizes:
        return max(sizes)
    counts = collections.Counter(n for p in model.parameters() for n in p.shape)
    if not counts:
        raise ConfigError("cannot resolve 'auto' bucket sizes: the model has no config.hidden_size and no "
                          "parameter to read a width from")
    return max(counts, key=lambda n: (counts[n], n))


def resolve_auto(cfg: ZeroplusConfig, model: torch.nn.Module, has_client_optimizer: bool,
                 compiled: bool = False, planned: bool = False) -> None:
    """Resolve every ``"auto"`` outside the batch triple, logging each resolution, and the keys left unset
    whose default depends on the run: ``resize_recompute.enabled`` is on unless ``compiled`` (the model or a
    module of it runs compiled) or pipelined, and with ``planned`` (a memory budget follows) the planner's."""
    recompute = cfg.zeroplus.resize_recompute
    if recompute.enabled is None:  # see note: recompute by default
        if compiled or cfg.zeroplus.parallel.pipeline > 1:
            recompute.enabled = False
        else:
            recompute.enabled = "auto" if planned else True
    param_dtypes = {p.dtype for p in model.parameters()}
    for block, dtype in ((cfg.fp16, torch.float16), (cfg.bf16, torch.bfloat16)):
        if block.enabled == "auto":
            block.enabled = param_dtypes == {dtype}
            logger.info("config: resolved %s.enabled 'auto' = %s (model parameters are %s)",
                        "fp16" if dtype == torch.float16 else "bf16", block.enabled, sorted(map(str, param_dtypes)))
    if cfg.gradient_clipping == "auto":
        raise ConfigError("config key 'gradient_clipping' is 'auto', which zeroplus cannot derive: give a number "
                          "(0 disables clipping)")
    zero = cfg.zero_optimization
    autos = {k: getattr(zero, k) for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                           "stage3_param_persistence_threshold")}
    if "auto" in autos.values():
        h = model_hidden_size(model)
        values = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
                  "stage3_param_persistence_threshold": 10 * h}
        for key, value in autos.items():
            if value == "auto":
                setattr(zero, key, values[key])
                logger.info("config: resolved zero_optimization.%s 'auto' = %d (hidden size %d)", key, values[key], h)
    if cfg.optimizer is not None:
        for key, value in list(cfg.optimizer.params.items()):
            if value != "auto":
                continue
            if key == "lr":
                raise ConfigError("config key 'optimizer.params.lr' is 'auto', which zeroplus cannot derive: give a "
                                  "number, or pass optimizer= to zeroplus.initialize")
            del cfg.optimizer.params[key]
            logger.info("config: resolved optimizer.params.%s 'auto' = the optimizer's default", key)
    elif has_client_optimizer is False and cfg.scheduler is not None and cfg.optimizer is None:
        raise ConfigError("config has a 'scheduler' but no 'optimizer' block and no optimizer= was passed")
    if cfg.scheduler is not None:
        lr = (cfg.optimizer.params.get("lr") if cfg.optimizer is not None else None)
        for key, value in list(cfg.scheduler.params.items()):
            if value != "auto":
                continue
            if key in SCHEDULER_KEYS_FROM_LR and lr is not None:
                cfg.scheduler.params[key] = lr
            elif key in SCHEDULER_KEYS_AT_ZERO:
                cfg.scheduler.params[key] = 0.0
            else:
                raise ConfigError(f"config key 'scheduler.params.{key}' is 'auto', which zeroplus cannot derive: "
                                  f"give a number")
            logger.info("config: resolved scheduler.params.%s 'auto' = %s", key, cfg.scheduler.params[key])


def auto_keys(cfg: ZeroplusConfig) -> list[str]:
    """The keys left to the planner."""
    zero, zp = cfg.zero_optimization, cfg.zeroplus
    keys = []
    if zero.stage == "auto":
        keys.append("zero_optimization.stage")
    if zero.offload_optimizer is not None and zero.offload_optimizer.ratio == "auto":
        keys.append("zero_optimization.offload_optimizer.ratio")
    if zp.shared_master_weights == "auto":
        keys.append("zeroplus.shared_master_weights")
    if zp.resize_recompute.enabled == "auto":
        keys.append("zeroplus.resize_recompute.enabled")
    keys += [f"zeroplus.optimizer_states.{k}" for k in ("exp_avg", "exp_avg_sq")
             if getattr(zp.optimizer_states, k) == "auto"]
    if zp.master_weights.dtype == "auto":
        keys.append("zeroplus.master_weights.dtype")
    sizes = (("tensor_parallel.autotp_size", cfg.tensor_parallel.autotp_size),
             ("expert_parallel.autoep_size", cfg.expert_parallel.autoep_size))
    keys += [key for key, value in sizes if value == "auto"]
    keys += [f"zero_optimization.{k}" for k in ("mics_shard_size", "zero_hpz_partition_size", "zero_quantized_weights",
                                                 "zero_quantized_gradients")
             if getattr(zero, k) == "auto"]
    return keys
