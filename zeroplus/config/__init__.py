"""Config layer: DeepSpeed's keys validated strictly, plus zeroplus's own ``"zeroplus"`` block.

Imports nothing else of zeroplus, so every layer may read its own part.
"""
from .blocks import (
                     ActivationCheckpointingConfig,
                     OffloadOptimizerConfig,
                     OffloadParamConfig,
                     OptimizerConfig,
                     SchedulerConfig,
                     ZeroConfig,
                     ZeroplusBlock,
)
from .keys import ConfigError
from .model import ZeroplusConfig
from .precision_blocks import BF16Config, FP16Config
from .resolve import auto_keys, load_config, model_hidden_size, parse_config, resolve_auto, resolve_batch
from .resolved import ResolvedConfig, ResolvedZeroConfig, resolved, resolved_zero
from .sizes import parse_bytes
from .unresolved import check_fillable, unfillable_autos
from .zero_stage import ZeroStage

__all__ = ["ActivationCheckpointingConfig", "auto_keys", "load_config", "ResolvedConfig", "ResolvedZeroConfig",
           "resolved", "resolved_zero", "BF16Config", "ConfigError", "FP16Config",
           "OffloadOptimizerConfig",
           "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "ZeroConfig", "ZeroplusBlock",
           "ZeroplusConfig", "check_fillable", "model_hidden_size", "parse_bytes", "parse_config", "resolve_auto",
           "resolve_batch", "unfillable_autos", "ZeroStage"]
