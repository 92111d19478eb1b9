"""Where zeroplus keeps files it writes for itself: ``ZEROPLUS_CACHE_DIR``, else
``$XDG_CACHE_HOME/zeroplus``, else ``~/.cache/zeroplus``."""
from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("ZEROPLUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zeroplus")
