"""Type-check zeroplus as it is installed: ``python tools/typecheck.py`` (``make lint`` and ``make test`` run it).

The repository keeps ``engine/``, ``offload/`` and ``kernels/`` beside ``zeroplus/`` and maps them into the package
(``setup.py``'s ``package_dir``, ``zeroplus/source_tree.py``); mypy has no such mapping, and checking ``zeroplus/``
alone would treat ``zeroplus.engine`` as missing and skip it. So the installed layout is built under
``build/typecheck/`` from hard links to the source files (a copy where links cannot be made), mypy checks that
tree with the repository's ``mypy.ini``, and its messages name the source files. Nothing in the repository is a
link; the tree is rebuilt on every run.
See note: types (docs/design-notes.md).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import mypy.api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mapped() -> tuple[str, ...]:
    """``zeroplus/source_tree.py``'s ``MAPPED``, read from that file alone (importing ``zeroplus`` would load torch)."""
    spec = importlib.util.spec_from_file_location("_source_tree", os.path.join(ROOT, "zeroplus", "source_tree.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.MAPPED)


MAPPED = _mapped()

TREE = os.path.join(ROOT, "build", "typecheck")


def _place(source: str, target: str) -> None:
    """Every ``.py`` file under ``source`` at the same place under ``target``."""
    for dirpath, _, files in os.walk(source):
        if "__pycache__" in dirpath:
            continue
        for name in files:
            if name.endswith((".py", ".pyi")) or name == "py.typed":
                src = os.path.join(dirpath, name)
                dst = os.path.join(target, os.path.relpath(src, source))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)


def build() -> dict[str, str]:
    """Lay out ``build/typecheck/zeroplus``; returns each tree prefix and the source prefix it stands for."""
    shutil.rmtree(TREE, ignore_errors=True)
    package = os.path.join(TREE, "zeroplus")
    _place(os.path.join(ROOT, "zeroplus"), package)
    prefixes = {}
    for name in MAPPED:
        _place(os.path.join(ROOT, name), os.path.join(package, name))
        prefixes[os.path.relpath(os.path.join(package, name), ROOT) + os.sep] = name + os.sep
    prefixes[os.path.relpath(package, ROOT) + os.sep] = "zeroplus" + os.sep
    return prefixes


def main() -> int:
    prefixes = build()
    workers = str(min(4, len(os.sched_getaffinity(0))))  # mypy's parallel checking: 58 s -> 27 s on 2 cores
    out, err, status = mypy.api.run(["--config-file", os.path.join(ROOT, "mypy.ini"),
                                     "--cache-dir", os.path.join(ROOT, "build", "typecheck-cache"),
                                     "--num-workers", workers, os.path.relpath(os.path.join(TREE, "zeroplus"))])
    for tree, source in prefixes.items():  # the longest (the mapped folders) first
        out = out.replace(tree, source)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main())
