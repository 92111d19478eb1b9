"""``import deepspeed`` served by ``zeroplus.deepspeed_api``, for a process that asked for it.

``install()`` puts each zeroplus module under the DeepSpeed name callers import (``SERVED``) in
``sys.modules``, sets each as an attribute of its parent (so ``deepspeed.runtime.lr_schedules``
resolves by attribute as well as by import), and puts a finder first on ``sys.meta_path`` that
answers any other ``deepspeed.*`` import with a ``ModuleNotFoundError`` saying that zeroplus does not
serve that module, instead of loading part of the real DeepSpeed beside zeroplus. It refuses when the
real DeepSpeed is already imported in this process: two engines would then answer to one name.
Rank 0 logs once that zeroplus serves the API. ``shim.py`` makes ``import deepspeed`` call it.
See note: deepspeed by name (docs/design-notes.md).
"""
from __future__ import annotations

import importlib
import importlib.abc
import logging
import os
import sys
from typing import Any

from zeroplus.deepspeed_api.shim import SHIM_MARK
from zeroplus.logs import setup_logging
from zeroplus.version import __version__

PREFIX = "zeroplus.deepspeed_api"
SERVED = {
    "deepspeed": "",
    "deepspeed.accelerator": ".accelerator",
    "deepspeed.checkpoint": ".checkpoint_utils",
    "deepspeed.checkpoint.utils": ".checkpoint_utils",
    "deepspeed.checkpointing": ".checkpointing",
    "deepspeed.comm": ".comm",
    "deepspeed.comm.comm": ".comm",
    "deepspeed.ops": ".ops",
    "deepspeed.ops.adam": ".ops",
    "deepspeed.ops.adagrad": ".ops",
    "deepspeed.ops.lamb": ".ops",
    "deepspeed.runtime": ".runtime",
    "deepspeed.runtime.activation_checkpointing": ".checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing": ".checkpointing",
    "deepspeed.runtime.engine": ".engine",
    "deepspeed.runtime.lr_schedules": ".lr_schedules",
    "deepspeed.runtime.zero": ".zero",
    "deepspeed.runtime.zero.offload_config": ".offload_config",
    "deepspeed.runtime.zero.partition_parameters": ".partition_parameters",
    "deepspeed.utils": ".utils",
    "deepspeed.zero": ".zero",
}
logger = logging.getLogger("zeroplus")


class _Unserved(importlib.abc.MetaPathFinder):
    """Any ``deepspeed.*`` module not in ``SERVED``: a clear ``ModuleNotFoundError``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname.startswith("deepspeed.") and fullname not in sys.modules:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: zeroplus serves DeepSpeed's API in this process (zeroplus run "
                f"--deepspeed-api / python -m zeroplus.deepspeed_api) and does not serve {fullname} yet",
                name=fullname)
        return None


def served_by_zeroplus() -> bool:
    module = sys.modules.get("deepspeed")
    return module is not None and getattr(module, "__name__", "") == PREFIX


def install() -> None:
    """Serve ``deepspeed`` and its served submodules from zeroplus in this process (idempotent)."""
    if served_by_zeroplus():
        return
    real = sys.modules.get("deepspeed")  # (the shim's package while its __init__ calls this: marked, wherever it is)
    if real is not None and getattr(real, "__file__", None) and not getattr(real, SHIM_MARK, False):
        raise RuntimeError(f"the real DeepSpeed ({real.__file__}) was imported in this process before zeroplus could "
                           f"serve DeepSpeed's API: start the process through `zeroplus run --deepspeed-api` or "
                           f"`python -m zeroplus.deepspeed_api`, before anything imports deepspeed")
    modules = {name: importlib.import_module(PREFIX + target) for name, target in SERVED.items()}
    sys.modules.update(modules)
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent and child not in vars(modules[parent]):
            setattr(modules[parent], child, module)
    if not any(isinstance(f, _Unserved) for f in sys.meta_path):
        sys.meta_path.insert(0, _Unserved())
    if os.environ.get("RANK", "0") == "0":  # before any process group: the launcher's rank
        setup_logging()
        logger.info("zeroplus %s serves DeepSpeed's API in this process: `import deepspeed` is %s", __version__,
                    PREFIX)
