"""How memory is named and drawn: the budget's categories, their labels, and charts for those who would
rather look than read (``pip install zeroplus[plotting]``). A leaf: it imports nothing of zeroplus, so
the budget (``budget/estimate.py``) and the engine's report (``memory_report.py``) both draw through it.

- ``budget_chart(budget, path)``: the predicted bytes per category stacked for each phase (init,
  forward, backward, step), the tallest bar being the predicted peak.
- ``report_chart(report, path)``: predicted beside measured, per ledger category (each
  category's own peak) and for the device's peak.

Both write a PNG and return its path. matplotlib is imported here only, with the non-interactive
Agg backend, so training never needs it.
"""
from __future__ import annotations

from typing import Any

CATEGORIES = ("param", "param_gathered", "grad", "master", "optim_state", "activation", "temporaries",
              "comm_buffer", "offload_buffer", "runtime")

LABELS = {"param": "parameters (low precision)", "param_gathered": "parameters gathered (stage 3)",
          "grad": "gradients", "master": "fp32 master weights", "optim_state": "optimizer states",
          "activation": "activations saved for backward", "temporaries": "autograd and kernel temporaries",
          "comm_buffer": "communication buckets", "offload_buffer": "offload windows",
          "runtime": "runtime overhead"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("charts need matplotlib: pip install 'zeroplus[plotting]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def budget_chart(budget: Any, path: str) -> str:
    """``budget``: a ``zeroplus.MemoryBudget``."""
    plt = _pyplot()
    phases = list(budget.phases)
    fig, ax = plt.subplots(figsize=(8, 5))
    bottoms = [0.0] * len(phases)
    for category in CATEGORIES:
        values = [budget.phases[p].get(category, 0) / 2**20 for p in phases]
        if any(values):
            ax.bar(phases, values, bottom=bottoms, label=LABELS[category])
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("MiB")
    ax.set_title(f"predicted memory, rank {budget.rank} of {budget.world_size} (ZeRO stage {budget.stage}); "
                 f"peak {budget.peak_bytes / 2**30:.2f} GiB in {budget.peak_phase}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report_chart(report: Any, path: str) -> str:
    """``report``: an ``Engine.memory_report()`` with a prediction."""
    if report.predicted is None:
        raise ValueError("the report has no prediction to chart (zeroplus.memory_estimate is off, or no forward ran)")
    plt = _pyplot()
    predicted = report.predicted_category_peaks()
    names = [c for c, b in report.categories.items() if b["peak_bytes"] or predicted.get(c)]
    measured_mib = [report.categories[c]["peak_bytes"] / 2**20 for c in names]
    predicted_mib = [predicted.get(c, 0) / 2**20 for c in names]
    names.append("device peak")
    measured_mib.append(report.process_peak_above_start_bytes / 2**20)
    predicted_mib.append(report.predicted_peak_bytes / 2**20)
    fig, ax = plt.subplots(figsize=(9, 5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], predicted_mib, width=0.4, label="predicted")
    ax.bar([i + 0.2 for i in x], measured_mib, width=0.4, label="measured")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MiB (peak)")
    error = report.peak_error_pct
    ax.set_title(f"rank {report.rank}: predicted vs measured peaks"
                 + (f" (device peak error {error:+.1f}%)" if error is not None else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
