"""One field of this process's ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM``, ``RssAnon``: kB there), or None
where ``/proc`` does not give it. The accelerator layer reads the process's memory with it, MKL's pool
(``host_gemm_pool.py``) what emptying it gave back."""
from __future__ import annotations

import contextlib


def status_bytes(field: str) -> int | None:
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    return None
