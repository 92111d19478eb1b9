"""zeroplus: a memory-first ZeRO-style training engine for PyTorch.

    engine = zeroplus.initialize(model, "ds_config.json")
    loss = loss_fn(engine(batch), target)
    engine.backward(loss)
    engine.step()
"""
from . import source_tree  # noqa: F401 - first: from a source checkout, finds engine/, offload/, kernels/
from .accelerator import get_accelerator as _get_accelerator
from .budget.estimate import MemoryBudget, estimate
from .config import ConfigError
from .engine.checkpoints.export import load_fp32_state_dict
from .engine.engine import Engine
from .host_allocator import mode_from_env as _host_allocator_mode
from .initialize_engine import initialize
from .memory_report import MemoryReport
from .parallel import init_parallel
from .version import __version__ as __version__
from .zero.construction import Init
from .zero.gathered import GatheredParameters

# a CPU rank's budget is its resident memory: freed memory goes back to the system from here on, before the script
# builds its model (ZEROPLUS_HOST_ALLOCATOR=keep leaves glibc as it is; see note: host allocator)
_get_accelerator().settle_host_allocator(_host_allocator_mode())

__all__ = ["ConfigError", "Engine", "GatheredParameters", "Init", "MemoryBudget", "MemoryReport", "estimate",
           "init_parallel", "initialize", "load_fp32_state_dict"]
