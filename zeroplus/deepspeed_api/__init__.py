"""DeepSpeed's API served by zeroplus: ``import zeroplus.deepspeed_api as deepspeed``, or unchanged
scripts through ``zeroplus run --deepspeed-api`` / ``python -m zeroplus.deepspeed_api`` (``alias.py``,
``shim.py``), under which ``import deepspeed`` is this package.

The surface is what Hugging Face's Trainer, Accelerate's DeepSpeed plugin and scripts in DeepSpeed's
tutorial shape call: ``initialize`` (``initialize.py``), ``DeepSpeedEngine`` (``engine.py``) and the
optimizer it returns (``optimizer.py``), ``zero.Init``/``zero.GatheredParameters``, ``comm``,
``ops`` (DeepSpeed's optimizer classes), ``utils``, ``accelerator``, ``checkpointing``,
``runtime.lr_schedules``, ``add_config_arguments``, ``init_distributed`` and ``tp_model_init``. A public name outside it
raises ``NotSupportedError`` (a ``NotImplementedError``) naming it (``unsupported.py``).
"""
from __future__ import annotations

import argparse

from . import accelerator, checkpoint_utils, checkpointing, comm, lr_schedules, ops, runtime, utils, zero
from .comm import init_distributed
from .engine import DeepSpeedEngine
from .initialize import initialize, tp_model_init
from .optimizer import DeepSpeedZeroOptimizer
from .shim import DIST_VERSION
from .unsupported import NotSupportedError, module_getattr
from .utils import log_dist, logger

__getattr__ = module_getattr("deepspeed")
__version__ = DIST_VERSION
version = DIST_VERSION
checkpoint = checkpoint_utils


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed``, ``--deepspeed_config`` (and the old ``--deepscale*``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (served by zeroplus)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (a flag for the script's own use)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="old name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="old name of --deepspeed_config")
    return parser


__all__ = ["DeepSpeedEngine", "DeepSpeedZeroOptimizer", "NotSupportedError", "accelerator", "add_config_arguments",
           "checkpoint", "checkpointing", "comm", "init_distributed", "initialize", "log_dist", "logger",
           "lr_schedules", "ops", "runtime", "tp_model_init", "utils", "version", "zero"]
