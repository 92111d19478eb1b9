"""The directory that makes ``import deepspeed`` mean zeroplus for a whole process tree.

It holds two things, written once per zeroplus version and content under the cache directory
(``zeroplus/cache_dir.py``): a package ``deepspeed`` whose ``__init__`` calls ``alias.install()``
(which replaces it in ``sys.modules`` by ``zeroplus.deepspeed_api``), and the distribution metadata
``deepspeed-<version>.dist-info``, so Transformers' and Accelerate's availability and version checks
(``importlib.util.find_spec``, ``importlib.metadata.version("deepspeed")``) find a DeepSpeed of the
API version served. Put first on ``PYTHONPATH``, it is found before any installed DeepSpeed by every
Python process started below it (torchrun's workers, DataLoader workers, subprocesses).
The version is ``API_VERSION`` plus ``+zeroplus``: the DeepSpeed release whose API and behaviour the
tests compare against.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from zeroplus.cache_dir import cache_root
from zeroplus.version import __version__

API_VERSION = "0.19.8"
DIST_VERSION = f"{API_VERSION}+zeroplus"

SHIM_MARK = "ZEROPLUS_SHIM"  # a global of the shim's package: ``alias.install`` tells it from the real DeepSpeed
_INIT = f'''"""Written by zeroplus: in this process tree `import deepspeed` is zeroplus.deepspeed_api."""
{SHIM_MARK} = True
from zeroplus.deepspeed_api.alias import install

install()
'''
_METADATA = f"""Metadata-Version: 2.1
Name: deepspeed
Version: {DIST_VERSION}
Summary: DeepSpeed's API {API_VERSION}, served by zeroplus {__version__}
"""


def shim_dir() -> str:
    """The directory to put first on ``PYTHONPATH`` (written if missing; safe when ranks race)."""
    # (named by what it holds too: a shim written by another build of this version is never taken)
    digest = hashlib.sha256((_INIT + _METADATA).encode()).hexdigest()[:12]
    final = os.path.join(cache_root(), f"deepspeed-api-{__version__}-{digest}")
    if os.path.isfile(os.path.join(final, "deepspeed", "__init__.py")):
        return final
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".deepspeed-api-", dir=cache_root())
    try:
        os.makedirs(os.path.join(tmp, "deepspeed"))
        with open(os.path.join(tmp, "deepspeed", "__init__.py"), "w") as f:
            f.write(_INIT)
        info = os.path.join(tmp, f"deepspeed-{DIST_VERSION}.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(_METADATA)
        with open(os.path.join(info, "top_level.txt"), "w") as f:
            f.write("deepspeed\n")
        try:
            os.rename(tmp, final)
        except OSError:  # another rank got there first
            if not os.path.isfile(os.path.join(final, "deepspeed", "__init__.py")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def environment_with_shim(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the shim first on ``PYTHONPATH``."""
    shim = shim_dir()
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != shim]
    return dict(env, PYTHONPATH=os.pathsep.join([shim, *rest]))
