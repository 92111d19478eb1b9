"""What this rank holds, per ledger category, as a table for people and a dict for tools.

Live bytes are what is allocated now; peak bytes the most ever allocated at once since the last
reset. ``process_peak_above_start_bytes`` is the device's peak (on CPU: the process's peak
resident memory, VmHWM, above the resident memory when the engine started), which also counts
what the ledger does not see (activations, temporaries, the runtime). ``saved`` lists, per
memory technique and category, the bytes it keeps from being held (live and peak).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .ledger import Category, Ledger


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:10.1f}"


@dataclasses.dataclass
class MemoryReport:
    rank: int
    categories: dict[str, dict[str, int]]
    total: dict[str, int]
    process_peak_above_start_bytes: int
    saved: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_ledger(cls, rank: int, ledger: Ledger, process_peak_above_start_bytes: int) -> MemoryReport:
        snap = ledger.snapshot()
        total, saved = snap.pop("total"), snap.pop("saved")
        return cls(rank, snap, total, process_peak_above_start_bytes, saved)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"memory on rank {self.rank} (MiB)", f"  {'category':<16}{'live':>10}{'peak':>10}"]
        for cat in Category:
            b = self.categories[cat.value]
            lines.append(f"  {cat.value:<16}{_mib(b['live_bytes'])}{_mib(b['peak_bytes'])}")
        lines.append(f"  {'total (ledger)':<16}{_mib(self.total['live_bytes'])}{_mib(self.total['peak_bytes'])}")
        lines.append(f"  {'process peak above start':<26}{_mib(self.process_peak_above_start_bytes)}")
        if self.saved:
            lines.append(f"  {'not held, by technique':<30}{'live':>10}{'peak':>10}")
            for key, b in self.saved.items():
                lines.append(f"  {key:<30}{_mib(b['live_bytes'])}{_mib(b['peak_bytes'])}")
        return "\n".join(lines)
