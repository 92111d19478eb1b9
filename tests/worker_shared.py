"""A result computed once per test session and shared by pytest-xdist's workers.

A module-scoped fixture runs once per worker, and the workers take a module's tests in any mix (pytest-xdist's
``xdist_group`` scheduling does not group them under pytest 9.2): an expensive launch that several tests read (the
Trainer and TRL against DeepSpeed) would run once in each worker. ``shared(tmp_path_factory, name, make)`` runs
``make(folder)`` in a folder shared by every worker of the session, under a file lock: the first worker to ask runs
it and keeps its JSON result there, any other waits for the lock and reads it. A ``make`` that raises keeps nothing,
so the next worker to ask runs it again (and fails the same way, in its own test).
"""
from __future__ import annotations

import fcntl
import json
import os
import pathlib
from typing import Any, Callable

import pytest


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> pathlib.Path:
    """``name``'s folder in the session's base temporary directory, the same for every worker."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # (each worker's base is a folder of the session's)
    folder = base / f"shared-{name}"
    folder.mkdir(exist_ok=True)
    return folder


def shared(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[pathlib.Path], Any]) -> Any:
    """``make(folder)``'s JSON result, computed by the first worker to ask."""
    folder = shared_folder(tmp_path_factory, name)
    with open(folder.parent / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = folder / "result.json"
        if done.exists():
            return json.loads(done.read_text())
        result = make(folder)
        done.write_text(json.dumps(result))
        return result
