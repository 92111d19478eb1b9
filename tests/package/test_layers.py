"""The layers run one way (``docs/design-notes.md``, "Layers").

Read from the source, imports inside functions and under ``if TYPE_CHECKING`` included: no import loop anywhere in
the package (imports that run, and those for the type checker); no import written inside a function (where one would
hide a loop); and every package and top-level module of ``zeroplus`` in one of the layers below, importing only from
its own layer or lower ones. A failure names the modules.
See note: layers (docs/design-notes.md).
"""
from __future__ import annotations

import pytest

from tests.package.import_graph import cycles, imports_in_functions, module_imports

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

# lowest first: a package (``zeroplus.<name>``) or a top-level module (``zeroplus.<name>.py``) per entry
LAYERS = [
    ("leaves", ["accelerator.py", "cache_dir.py", "collective_faults.py", "collectives.py", "comm.py",
                "comm_observers.py", "comms_log.py", "cpu_precision.py", "data.py", "eager.py", "fault_dumps.py",
                "flight_recorder.py", "host_allocator.py", "host_gemm_pool.py", "host_kernel_cache.py", "ledger.py",
                "logs.py", "memory_report.py", "memory_view.py", "meta_values.py", "proc_status.py", "shm_pair.py",
                "source_tree.py", "transports.py", "version.py"]),
    ("config", ["config"]),
    ("kernels", ["kernels"]),
    ("offload", ["offload"]),
    ("optimizers", ["optim"]),
    ("parallelism", ["parallel"]),
    ("embedding tables", ["embeddings"]),
    ("activation techniques", ["activations", "checkpointing.py", "fused_ops.py"]),
    ("models", ["models"]),
    ("partitioning", ["zero"]),
    ("engine", ["engine"]),
    ("memory budget", ["budget"]),
    ("initialize", ["initialize_engine.py", "runtime_probe.py"]),
    ("DeepSpeed's API", ["deepspeed_api"]),
    ("the top", ["<init>", "launcher.py", "dlrm_job.py", "job_report.py", "train_job.py", "cli.py"]),
]
RANK = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def _part(module: str) -> str:
    """The layer entry a module belongs to: its package under ``zeroplus``, or its own file."""
    parts = module.split(".")
    if len(parts) == 1:
        return "<init>"
    return parts[1] if parts[1] in RANK else parts[1] + ".py"


def test_no_import_loops():
    """Neither among the imports that run nor among those written for the type checker only (``if TYPE_CHECKING``):
    a type-level loop is a layering the code hides, as when a mechanism is typed against the class that calls it
    (the checkpoint mechanisms read ``EngineAccessors``, not ``Engine``)."""
    assert cycles(module_imports()) == []
    assert cycles(module_imports(type_checking=True)) == []


def test_no_imports_inside_functions():
    assert imports_in_functions() == []


def test_every_module_is_in_a_layer():
    missing = sorted({_part(m) for m in module_imports()} - set(RANK))
    assert missing == [], f"not in LAYERS: {missing}"


def test_layers_import_only_downwards():
    upward = sorted((m, t) for m, targets in module_imports(type_checking=True).items() for t in targets
                    if RANK.get(_part(t), -1) > RANK.get(_part(m), len(LAYERS)))
    assert upward == [], "\n".join(f"{m} ({LAYERS[RANK[_part(m)]][0]}) imports {t} ({LAYERS[RANK[_part(t)]][0]})"
                                   for m, t in upward)
