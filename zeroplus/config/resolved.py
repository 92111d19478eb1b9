"""The resolved config: what the layers below ``zeroplus.initialize`` receive.

A parsed ``ZeroplusConfig`` may still say ``"auto"`` (batch sizes, ZeRO stage, bucket sizes, offload
ratio, shared master weights, resize recompute, fp16/bf16) or leave the batch triple unset. The top
layer resolves them (``resolve.py``, the planner) and then calls ``resolved(cfg)``: a
``ResolvedConfig``, whose field types hold no ``"auto"`` and no unset batch size, so the engine,
partitioning and the budget's simulation read plain ints, floats and bools. Resolving twice is
harmless; a key still ``"auto"`` is a ``ConfigError`` naming it.
See note: resolved config (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from .blocks import (
    NonNegativeFloat,
    NonNegativeInt,
    OffloadOptimizerConfig,
    PositiveInt,
    ResizeRecomputeConfig,
    ZeroConfig,
    ZeroplusBlock,
    freeze,
)
from .keys import ConfigError
from .model import ZeroplusConfig
from .precision_blocks import BF16Config, FP16Config
from .zero_stage import ZeroStage


class ResolvedFP16Config(FP16Config):
    enabled: bool = False


class ResolvedBF16Config(BF16Config):
    enabled: bool = False


class ResolvedOffloadOptimizerConfig(OffloadOptimizerConfig):
    ratio: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0


class ResolvedZeroConfig(ZeroConfig):
    stage: ZeroStage = ZeroStage.NONE  # the stage as a policy (zero_stage.py)
    reduce_bucket_size: PositiveInt = 500_000_000
    stage3_prefetch_bucket_size: NonNegativeInt | None = None
    stage3_param_persistence_threshold: NonNegativeInt = 100_000
    mics_shard_size: int = -1
    zero_hpz_partition_size: int = 1
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    offload_optimizer: ResolvedOffloadOptimizerConfig | None = None


class ResolvedResizeRecomputeConfig(ResizeRecomputeConfig):
    enabled: bool = False
    by_default: bool = False  # on because the key was left unset: stands down when the model is compiled later


class ResolvedZeroplusBlock(ZeroplusBlock):
    shared_master_weights: bool = False
    resize_recompute: ResolvedResizeRecomputeConfig = Field(default_factory=ResolvedResizeRecomputeConfig)


class ResolvedConfig(ZeroplusConfig):
    """A config with every ``"auto"`` resolved and the batch triple set."""

    train_batch_size: PositiveInt
    train_micro_batch_size_per_gpu: PositiveInt
    gradient_accumulation_steps: PositiveInt
    gradient_clipping: NonNegativeFloat = 0.0
    fp16: ResolvedFP16Config = Field(default_factory=ResolvedFP16Config)
    bf16: ResolvedBF16Config = Field(default_factory=ResolvedBF16Config)
    zero_optimization: ResolvedZeroConfig = Field(default_factory=ResolvedZeroConfig)
    zeroplus: ResolvedZeroplusBlock = Field(default_factory=ResolvedZeroplusBlock)


_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# keys whose "auto" is a value: what it means is decided when the engine is assembled, from the groups it runs on
# (zeroplus.transport: comm.DataParallelGroup.use_transport; zeroplus.techniques_by_default: the accelerator's), not by
# resolution
_ASSEMBLY_CHOICES = ("zeroplus.transport", "zeroplus.techniques_by_default")


def _unresolved(data: Any, path: str) -> list[str]:
    if isinstance(data, dict):
        return [k for key, value in data.items() if key != "params" for k in _unresolved(value, f"{path}{key}.")]
    return [path[:-1]] if data == "auto" and path[:-1] not in _ASSEMBLY_CHOICES else []


def resolved_zero(zero: ZeroConfig) -> ResolvedZeroConfig:
    """The ``zero_optimization`` block alone, resolved (the budget's model-state count has no batch)."""
    if isinstance(zero, ResolvedZeroConfig):
        return zero
    left = _unresolved(zero.model_dump(), "zero_optimization.")
    if left:
        raise ConfigError(f"config keys {left} are still 'auto': give them values, or let the planner choose "
                          f"within 'zeroplus.memory_budget'")
    return ResolvedZeroConfig.model_validate(zero.model_dump())


def resolved(cfg: ZeroplusConfig, recompute_unset: bool = False) -> ResolvedConfig:
    """``cfg`` as a ``ResolvedConfig``, frozen (a copy; ``cfg`` itself when it already is one): from here the
    engine reads it and never writes it; what it decides at run time lives in its own objects (see note: frozen
    config). ``recompute_unset``: the caller's config left ``resize_recompute.enabled`` unset, so resize recompute,
    if on, is on by default (``by_default``: a compiled model or the budget may stand it down)."""
    if isinstance(cfg, ResolvedConfig):
        return freeze(cfg)  # type: ignore[return-value]
    data = cfg.model_dump()
    recompute = data["zeroplus"]["resize_recompute"]
    if recompute["enabled"] is None:  # unset and not resolved by ``resolve_auto``: its default, on
        recompute.update(enabled=True, by_default=True)
    elif recompute_unset and recompute["enabled"] is True:
        recompute["by_default"] = True
    left = _unresolved(data, "") + [key for key in _BATCH if data[key] is None]
    if left:
        raise ConfigError(f"config keys {left} are still 'auto' or unset after resolution: give them values "
                          f"(the batch triple needs two of its three keys; 'auto' keys of the ZeRO block, "
                          f"offload and memory techniques are chosen within 'zeroplus.memory_budget')")
    return freeze(ResolvedConfig.model_validate(data))  # type: ignore[return-value]
