import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("ZEROPLUS_ACCELERATOR", "cpu")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under `pytest -n N` each worker is one of N processes sharing the cores with the ranks the others fork: torch's
    # default of one intra-op thread per core oversubscribes them, and its idle threads spin. One thread per worker
    # (the ranks already take one: tests/dist_helper.py); a single-process run keeps torch's default.
    # inductor's compile workers likewise: one compile at a time in the worker's own process, not a pool of
    # subprocesses started by every rank that compiles
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import torch
    torch.set_num_threads(1)


import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# One cache folder for the whole run, shared by its workers, the ranks they fork and every subprocess a test starts
# (set here, when pytest loads this file, so an environment copied at a test module's import has it too): the runtime
# probe runs once per dtype in a run (tests/budget/test_runtime_overhead.py checks what it kept), and the suite reads
# nothing an earlier run or another checkout measured. Made by the process that runs pytest (xdist's workers inherit
# it) and removed when it ends; ``ZEROPLUS_CACHE_DIR`` set outside the run is kept as it is.
_MADE_CACHE = None
if "ZEROPLUS_CACHE_DIR" not in os.environ:
    _MADE_CACHE = os.environ["ZEROPLUS_CACHE_DIR"] = tempfile.mkdtemp(prefix="zeroplus-suite-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MADE_CACHE is not None:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def suite_cache_dir() -> str:
    """The run's cache folder (above)."""
    return os.environ["ZEROPLUS_CACHE_DIR"]
