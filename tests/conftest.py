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
