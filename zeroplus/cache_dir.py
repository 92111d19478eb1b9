"""Where zeroplus keeps files it writes for itself, and how: ``ZEROPLUS_CACHE_DIR``, else
``$XDG_CACHE_HOME/zeroplus``, else ``~/.cache/zeroplus``; one small JSON record per file, named by a
hash of what it depends on (host, versions), read leniently (a missing or broken file reads as
nothing) and written atomically (a temporary file renamed over it), so ranks that race are harmless."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any


def cache_root() -> str:
    return os.environ.get("ZEROPLUS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zeroplus")


def cache_file(prefix: str, key: dict[str, str]) -> str:
    """``<cache root>/<prefix>-<hash of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_root(), f"{prefix}-{digest}.json")


def read_record(path: str) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else None
    return None


def write_record(path: str, record: dict[str, Any]) -> None:
    """Write ``record`` atomically; a cache that cannot be written is skipped."""
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".record-")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
