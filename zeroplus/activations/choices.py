"""Which activation techniques an engine runs, and why: the engine's decisions, kept apart from its config.

The resolved config is frozen (see note: frozen config): it says what the user asked for, resolved, and is never written
afterwards. What the engine decides at run time lives here: resize recompute, the lean loss and embedding rows left
unset are on by default, and stand down at the first forward where the memory budget finds the run fits without them on
a device whose defaults are "where needed" (see note: techniques by default), or resize recompute keeps nothing off the
peak (see note: recompute where it pays) or the model turns out compiled. ``engine.choices`` holds one
``TechniqueChoice`` per technique; each says whether it runs and why, and the technique reads it at each forward.
Memory: a few strings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class TechniqueChoice:
    """Whether ``technique`` runs in this engine, and why. ``by_default``: on because the config left it
    unset, so the engine may stand it down (``stand_down``); a technique the config turned on stays on."""

    technique: str
    on: bool
    by_default: bool
    why: str
    # told once when the technique stands down (``when_off``): what exists only to run it may go then
    _when_off: list[Callable[[], None]] = field(default_factory=list, repr=False, compare=False)

    def stand_down(self, why: str) -> None:
        """Off from the next forward on, for ``why`` (for good: nothing turns a technique on again)."""
        was_on, self.on, self.why = self.on, False, why
        while was_on and self._when_off:
            self._when_off.pop(0)()

    def when_off(self, call: Callable[[], None]) -> None:
        """``call()`` when this technique stands down; at once if it is off already."""
        if self.on:
            self._when_off.append(call)
        else:
            call()

    def describe(self) -> str:
        return f"{self.technique} {'on' if self.on else 'off'}: {self.why}"


def technique_choices(cfg: Any) -> dict[str, TechniqueChoice]:
    """The choices a resolved config starts an engine with."""
    recompute = cfg.zeroplus.resize_recompute
    if recompute.by_default:
        why = "on by default (zeroplus.resize_recompute.enabled unset)"
    else:
        why = f"zeroplus.resize_recompute.enabled is {str(bool(recompute.enabled)).lower()}"
    swap = cfg.zeroplus.swap_attention
    lean = cfg.zeroplus.lean_cross_entropy
    lean_why = ("on by default (zeroplus.lean_cross_entropy unset)" if lean is None
                else f"zeroplus.lean_cross_entropy is {str(lean).lower()}")
    rows = cfg.zeroplus.embedding_rows
    rows_why = ("on by default (zeroplus.embedding_rows unset)" if rows is None
                else f"zeroplus.embedding_rows is {str(rows).lower()}")
    return {"resize_recompute": TechniqueChoice("resize_recompute", bool(recompute.enabled), bool(recompute.by_default),
                                                why),
            "lean_cross_entropy": TechniqueChoice("lean_cross_entropy", lean is not False, lean is None, lean_why),
            "embedding_rows": TechniqueChoice("embedding_rows", rows is not False, rows is None, rows_why),
            "swap_attention": TechniqueChoice("swap_attention", bool(swap.enabled), False,
                                              f"zeroplus.swap_attention.enabled is {str(bool(swap.enabled)).lower()}")}


__all__ = ["TechniqueChoice", "technique_choices"]
