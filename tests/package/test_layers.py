"""The layers run one way (``docs/design-notes.md``, "Layers").

Read from the source, imports inside functions included: no import loop anywhere in the package; no
import written inside a function (where one would hide a loop); the engine never imports the memory
budget or the top layer (``initialize_engine.py``), and the layers below the engine (config,
partitioning, offload, kernels) import neither. A failure names the modules.
"""
from __future__ import annotations

import pytest

from tests.package.import_graph import cycles, imports_in_functions, module_imports

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

# layer: what it must never import (prefixes)
FORBIDDEN = {
    "zeroplus.config": ("zeroplus.zero", "zeroplus.offload", "zeroplus.engine", "zeroplus.budget",
                        "zeroplus.initialize_engine"),
    "zeroplus.zero": ("zeroplus.engine", "zeroplus.budget", "zeroplus.initialize_engine"),
    "zeroplus.offload": ("zeroplus.zero", "zeroplus.engine", "zeroplus.budget", "zeroplus.initialize_engine"),
    "zeroplus.kernels": ("zeroplus.zero", "zeroplus.engine", "zeroplus.budget", "zeroplus.initialize_engine"),
    "zeroplus.engine": ("zeroplus.budget", "zeroplus.initialize_engine", "zeroplus.cli", "zeroplus.train_job"),
    "zeroplus.budget": ("zeroplus.initialize_engine",),
}


def test_no_import_loops():
    assert cycles(module_imports()) == []


def test_no_imports_inside_functions():
    assert imports_in_functions() == []


def test_layers_import_only_downwards():
    wrong = [(module, target) for module, targets in module_imports().items() for target in targets
             for layer, banned in FORBIDDEN.items()
             if (module == layer or module.startswith(layer + ".")) and target.startswith(banned)]
    assert wrong == []
