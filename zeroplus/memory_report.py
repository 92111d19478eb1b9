"""What this rank holds, per ledger category, as a table for people and a dict for tools.

Live bytes are what is allocated now; peak bytes the most ever allocated at once since the last
reset; the ``activation`` row's peak adds what the first training forward left alive for backward
(``activations/forward_census.py``) to what the engine moves itself.
``process_peak_above_start_bytes`` is the device's peak since ``initialize`` (on CPU: the process's
peak resident memory, VmHWM, above the resident memory when ``initialize`` started less the model's
own bytes, which count as the engine's), which also counts what neither sees (temporaries, the
runtime). ``saved`` lists, per memory technique and category, the bytes it keeps from being held
(live and peak).

``baseline_bytes`` is what the process held when ``initialize`` started, less the model's own
tensors (on CPU: resident memory; on a device: its allocated memory): imported modules (torch,
``torch._dynamo``, Transformers), the user's data, an earlier engine. It is paid before the engine
exists, so it is neither predicted nor counted as error; it is shown as its own line, with the
process's peak (baseline plus the peak above start) beside it.

``predicted`` is the engine's ``MemoryBudget`` (``zeroplus.estimate`` at the first forward) as a
dict, when there is one: each ledger category's predicted peak stands beside the measured one,
and the predicted device peak beside the measured, with the error in percent.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .ledger import Category, Ledger
from .memory_view import report_chart


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:10.1f}"


def _pct(predicted: int, measured: int) -> str:
    if measured <= 0:
        return f"{'-':>9}" if predicted == 0 else f"{'new':>9}"
    return f"{100.0 * (predicted - measured) / measured:+8.1f}%"


@dataclasses.dataclass
class MemoryReport:
    rank: int
    categories: dict[str, dict[str, int]]
    total: dict[str, int]
    process_peak_above_start_bytes: int
    saved: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    predicted: dict[str, Any] | None = None
    checkpoint_saved: bool = False  # the measured peak covers a save: compare it with the peak that includes one
    baseline_bytes: int = 0  # held before initialize (imports, data, earlier engines): neither predicted nor error

    @classmethod
    def from_ledger(cls, rank: int, ledger: Ledger, process_peak_above_start_bytes: int,
                    budget: Any = None, checkpoint_saved: bool = False, saved_for_backward: int = 0,
                    baseline_bytes: int = 0) -> MemoryReport:
        """``saved_for_backward``: what the first training forward left alive outside the ledger
        (``activations/forward_census.py``), added to the ``activation`` row's peak."""
        snap = ledger.snapshot()
        total, saved = snap.pop("total"), snap.pop("saved")
        snap[Category.ACTIVATION.value]["peak_bytes"] += saved_for_backward
        return cls(rank, snap, total, process_peak_above_start_bytes, saved,
                   budget.to_dict() if budget is not None else None, checkpoint_saved, baseline_bytes)

    @property
    def predicted_peak_bytes(self) -> int | None:
        """The predicted peak this run has reached so far: with a checkpoint save once it has saved one."""
        if self.predicted is None:
            return None
        return int(self.predicted["peak_bytes" if self.checkpoint_saved else "training_peak_bytes"])

    @property
    def predicted_peak_phase(self) -> str | None:
        if self.predicted is None:
            return None
        return self.predicted["peak_phase" if self.checkpoint_saved else "training_peak_phase"]

    @property
    def peak_error_pct(self) -> float | None:
        """(predicted - measured) / measured device peak, in percent."""
        predicted, measured = self.predicted_peak_bytes, self.process_peak_above_start_bytes
        if predicted is None or measured <= 0:
            return None
        return 100.0 * (predicted - measured) / measured

    @property
    def technique_effects(self) -> dict[str, int]:
        """Bytes each activation technique takes off the predicted training peak (the budget's
        ``technique_effects``; empty without a prediction), unlike ``saved``: the most it moved at once."""
        return dict(self.predicted.get("technique_effects", {})) if self.predicted is not None else {}

    def predicted_category_peaks(self) -> dict[str, int] | None:
        """Each category's predicted peak beside the measured one: the ledger's, with what autograd saves
        for backward (the budget's ``saved_for_backward``) in ``activation``, as it is measured."""
        if self.predicted is None:
            return None
        peaks = dict(self.predicted["category_peaks"])
        peaks["activation"] = peaks.get("activation", 0) + int(self.predicted.get("saved_for_backward", 0))
        return peaks

    def save_chart(self, path: str) -> str:
        """A PNG of predicted beside measured peaks per category (``zeroplus[plotting]``)."""
        return report_chart(self, path)

    def peak_line(self) -> str:
        """One line: the peak above ``initialize``, the prediction beside it, and the baseline apart."""
        line = f"memory peak {self.process_peak_above_start_bytes / 2**30:.3f} GiB"
        predicted = self.predicted_peak_bytes
        if predicted is not None:
            error = self.peak_error_pct
            line += (f", predicted {predicted / 2**30:.3f} GiB in {self.predicted_peak_phase}"
                     + (f" ({error:+.1f}%)" if error is not None else ""))
        if self.baseline_bytes:
            line += f"; baseline before initialize {self.baseline_bytes / 2**30:.3f} GiB, outside the budget"
        return line

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        peaks = self.predicted_category_peaks()
        head = f"  {'category':<16}{'live':>10}{'peak':>10}" + (f"{'predicted':>11}{'error':>9}" if peaks else "")
        lines = [f"memory on rank {self.rank} (MiB)", head]
        for cat in Category:
            b = self.categories[cat.value]
            line = f"  {cat.value:<16}{_mib(b['live_bytes'])}{_mib(b['peak_bytes'])}"
            if peaks:
                line += f" {_mib(peaks.get(cat.value, 0))}{_pct(peaks.get(cat.value, 0), b['peak_bytes'])}"
            lines.append(line)
        lines.append(f"  {'total (ledger)':<16}{_mib(self.total['live_bytes'])}{_mib(self.total['peak_bytes'])}")
        predicted = self.predicted_peak_bytes
        lines.append(f"  {'device peak above start':<26}{_mib(self.process_peak_above_start_bytes)}"
                     + (f" {_mib(predicted)}{_pct(predicted, self.process_peak_above_start_bytes)}"
                        f"  (predicted in {self.predicted_peak_phase})" if predicted is not None else ""))
        if self.baseline_bytes:
            lines.append(f"  {'baseline before initialize':<26}{_mib(self.baseline_bytes)}  (imports, data, earlier "
                         "engines: outside the budget, not error)")
            lines.append(f"  {'process peak':<26}{_mib(self.baseline_bytes + self.process_peak_above_start_bytes)}")
        for technique, why in (self.predicted or {}).get("not_needed", {}).items():  # see note: techniques by default
            lines.append(f"  {technique} (on by default) is {why}")
        for technique, effect in (self.predicted or {}).get("stood_down", {}).items():
            lines.append(f"  {technique} (on by default) is off: it would take at most {effect / 2**20:.1f} MiB off "
                         f"the steps' predicted peak")
        if self.saved:
            effects = self.technique_effects
            lines.append(f"  {'not held, by technique':<30}{'live':>10}{'most':>10}{'off peak':>10}")
            for key, b in self.saved.items():
                effect = effects.get(key.split("/")[0])
                lines.append(f"  {key:<30}{_mib(b['live_bytes'])}{_mib(b['peak_bytes'])}"
                             + (_mib(effect) if effect is not None else f"{'-':>10}"))
            lines.append("  (most: the bytes moved off at once" + ("; off peak: what the technique takes off the "
                         "predicted peak, simulated with it and without it)" if effects else ")"))
        return "\n".join(lines)
