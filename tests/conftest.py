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


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def suite_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One cache folder for the whole run, shared by its workers and the ranks they start: the runtime probe runs
    once per dtype in a run (tests/budget/test_runtime_overhead.py checks what it kept) and the suite reads nothing
    measured by an earlier run or another checkout. ``ZEROPLUS_CACHE_DIR`` set outside the run is kept."""
    from tests.worker_shared import shared_folder
    os.environ.setdefault("ZEROPLUS_CACHE_DIR", str(shared_folder(tmp_path_factory, "zeroplus-cache")))
    return os.environ["ZEROPLUS_CACHE_DIR"]
