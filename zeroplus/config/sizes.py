"""Sizes in bytes as users write them: ``16GB``, ``16GiB``, ``1.5e10``."""
from __future__ import annotations

import re

from .keys import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: str | int | float, what: str = "config key 'zeroplus.memory_budget'") -> int:
    """``16GB`` (10^9), ``16GiB`` (2^30), ``1.5e10`` or a plain number of bytes; ``what`` names the
    setting in the error."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what} is {value!r}: give bytes as a number or with a unit "
                          f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '16GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
