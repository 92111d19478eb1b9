"""The design card's top-level folders as zeroplus's own subpackages, wherever zeroplus runs from.

The repository keeps ``engine/``, ``offload/`` and ``kernels/`` (and ``configs/``) beside ``zeroplus/``, and
the package is ``zeroplus.engine``, ``zeroplus.offload``, ``zeroplus.kernels``. An install (``pip install .``,
a wheel) puts them inside the package (``setup.py``'s ``package_dir``). A source checkout on ``sys.path`` (the
tests, ``python -m zeroplus.cli`` from the repository, an editable install) has them beside it: ``install()``
adds a finder that loads ``zeroplus.<name>`` from ``../<name>`` for exactly these names, so no top-level
``engine`` or ``kernels`` module exists to shadow another package, and nothing is linked. ``configs_dir()``
is the folder of the shipped configs either way.

Memory: nothing; the finder is consulted only for names it does not own (returning None) and these three.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Sequence

MAPPED = ("engine", "offload", "kernels")  # subpackages whose code lives in the repository's top-level folders
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PACKAGE)


class _TopLevelFolders(importlib.abc.MetaPathFinder):
    """Finds ``zeroplus.<name>`` for ``name`` in ``MAPPED`` in the top-level folder ``<root>/<name>``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != "zeroplus" or name not in MAPPED:
            return None
        folder = os.path.join(_ROOT, name)
        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def from_source() -> bool:
    """True when this zeroplus runs from a source checkout (its mapped folders beside the package, not in it)."""
    return not os.path.isdir(os.path.join(_PACKAGE, MAPPED[0])) and \
        os.path.isfile(os.path.join(_ROOT, MAPPED[0], "__init__.py"))


def install() -> None:
    """Add the finder (once) when running from source; an installed package needs none."""
    if from_source() and not any(isinstance(f, _TopLevelFolders) for f in sys.meta_path):
        sys.meta_path.insert(0, _TopLevelFolders())


def configs_dir() -> str:
    """The shipped configs: ``zeroplus/configs`` when installed, the repository's ``configs/`` from source."""
    inside = os.path.join(_PACKAGE, "configs")
    return inside if os.path.isdir(inside) else os.path.join(_ROOT, "configs")


install()  # on import: zeroplus/__init__.py imports this module before any mapped subpackage
