"""A CPU process's matrix-product kernel caches: ``import zeroplus`` bounds them, and the budget counts them full.

A bf16 product on CPU keeps a oneDNN kernel per shape in two caches of 1024 entries each (``zeroplus/
host_kernel_cache.py``; see note: host kernel caches). Products whose batch size changes every call (a routed
expert's) add an entry each, so a process grows by hundreds of MiB before they are full; under ``import zeroplus``
oneDNN's holds ``CAPACITY`` entries and ideep's fewer, so it stops at about what the runtime probe measured
(``kernel_cache``), which the budget adds to a routed model from its first routing on. ``ZEROPLUS_HOST_ALLOCATOR=keep``
(like a process's own capacities) leaves them, and a routed model's prediction then says it grows beyond. The
programs run in their own processes: the capacities are read at a process's first bf16 product.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

import zeroplus
from zeroplus.cpu_precision import native_bf16
from zeroplus.host_kernel_cache import CAPACITY, IDEEP_CAPACITY, IDEEP_ENV, ONEDNN_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 150 bf16 products of a 512 x 1024 weight at as many batch sizes, forward and backward (450 kernels), after a
# first one; prints the resident MiB they left (freed memory returned first), then what ``said`` finds
_GROWTH = """
import ctypes, torch
import zeroplus
from tests.budget.test_host_kernel_cache import said
def rss():
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
w = torch.zeros(1024, 512, dtype=torch.bfloat16, requires_grad=True)
def product(rows):
    torch.nn.functional.linear(torch.zeros(rows, 512, dtype=torch.bfloat16, requires_grad=True), w).sum().backward()
product(1)
before = rss()
for rows in range(2, 152):
    product(rows)
w.grad = None
print(repr((rss() - before, os.environ.get("LRU_CACHE_CAPACITY"), said(FAMILIES))))
"""


def _run(program: str, **env: str) -> tuple[float, str | None, tuple[str | None, list]]:
    environment = {k: v for k, v in os.environ.items() if k not in (ONEDNN_ENV, IDEEP_ENV)}
    environment.update(env, ZEROPLUS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-c", "import os\n" + program], env=environment, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def said(families: tuple[str, ...]) -> tuple[str | None, list[tuple[list[str], bool, bool]]]:
    """oneDNN's capacity variable, and the estimates of ``families`` (tiny) in bf16 on CPU: each one's caveats, whether
    its training peak's runtime row holds the full kernel caches beyond the runtime probe's figure, and whether it
    holds nothing beyond it."""
    from tests.hf_models import build
    from zeroplus.budget.runtime_overhead import kernel_cache_bytes, runtime_bytes
    ids = torch.randint(0, 256, (2, 24))
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    found = []
    for family in families:
        budget = zeroplus.estimate(build(family, "tiny"), config, world_size=1,
                                   example_kwargs={"input_ids": ids, "labels": ids}, accelerator="cpu")
        extra = budget.phases[budget.training_peak_phase]["runtime"] - runtime_bytes("cpu", "bf16")[1]
        found.append((budget.caveats, extra == kernel_cache_bytes("cpu", "bf16") > 2**20, extra == 0))
    return os.environ.get(ONEDNN_ENV), found


@pytest.mark.skipif(not native_bf16(), reason="oneDNN's bf16 kernels: a CPU with bf16 instructions")
def test_import_zeroplus_bounds_the_kernel_caches_and_a_routed_model_is_budgeted_with_them_full():
    """Under ``import zeroplus`` the 450 kernels leave a full cache of ``CAPACITY`` (about 50 MiB here, 2026-12-05),
    and the process's children get the same variables. Mixtral in bf16 on CPU: the prediction holds that cache from
    the first routing on and says nothing more (before, -17% to -43% of the matrix's measured peaks, with a caveat);
    Llama, without a router, holds none (the second estimate in this process, which imported zeroplus)."""
    grown, ideep, (onednn, found) = _run(_GROWTH.replace("FAMILIES", "()"))
    assert grown < 80, grown
    assert (onednn, ideep) == (str(CAPACITY), str(IDEEP_CAPACITY))
    capacity, found = said(("mixtral", "llama"))
    assert capacity == str(CAPACITY) and found == [([], True, False), ([], False, True)], found


@pytest.mark.skipif(not native_bf16(), reason="oneDNN's bf16 kernels: a CPU with bf16 instructions")
def test_keep_leaves_the_kernel_caches_to_grow_and_a_routed_models_prediction_says_so():
    """``ZEROPLUS_HOST_ALLOCATOR=keep``: the caches keep their 1024 entries each, so the 450 kernels stay (0.46 MiB
    each here: about 200 MiB, as in a process without zeroplus), and Mixtral's prediction says the run grows beyond
    it."""
    grown, ideep, (onednn, [(caveats, counted, _)]) = _run(_GROWTH.replace("FAMILIES", "('mixtral',)"),
                                                           ZEROPLUS_HOST_ALLOCATOR="keep")
    assert grown > 150 and onednn is None and ideep is None, (grown, onednn, ideep)
    assert counted and any(f"{ONEDNN_ENV}=1024" in c and "grows step by step above this prediction" in c
                           for c in caveats), caveats
