"""``zeroplus <command> ...`` run in the test's own process (``zeroplus.cli.main``), its output taken from pytest's
``capsys``: the same code as the console script after ``main``, without a new interpreter's imports (5-6 s each here).
One test per command still starts the real process (the entry point): ``tests/budget/test_estimate.py``'s
full budget for ``estimate``."""
from __future__ import annotations

from typing import Any


def run_cli(args: list[str], capsys: Any) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``zeroplus`` with ``args``."""
    from zeroplus.cli import main
    capsys.readouterr()
    try:
        status = main(list(args))
    except SystemExit as err:  # argparse's errors
        status = err.code if isinstance(err.code, int) else 1
    out = capsys.readouterr()
    return status, out.out, out.err
