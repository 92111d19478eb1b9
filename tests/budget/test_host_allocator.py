"""glibc as a user leaves it: a CPU rank returns what it frees, so the budget's figure is the measured one.

``import zeroplus`` fixes glibc's mmap and trim thresholds (``zeroplus/host_allocator.py``; see note: host
allocator). Without it, a process that freed one 8 MiB block has its threshold raised, so a hundred 1 MiB
blocks come from the heap and stay resident once freed (glibc trims the heap only from its top, and one block
is still held there); with it they are mapped and unmapped. The corners of ``bench/bench_matrix.py`` run in the
suite at its ``test`` scale, launched as a user launches them (torchrun, no ``MALLOC_*`` variables, ZeRO-3, 2
gloo ranks, the GPT at 21M): written with ``torch.nn`` classes and the optimizer from the config, and with its own
module classes and a client optimizer, every rank's budget error within the issue's 5% (measured 2026-12-03 with
glibc's thresholds at 32 KiB: -1.2% to -1.4% and -2.5% to -2.7%; at 128 KiB they were -2.8% and -4.6%, the
difference freed blocks below live ones in the heap). One launch more where a rank is outside, as
``test_budget_in_process.py`` does: a small model's runtime moves by about a point between launches.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 5.0  # percent of the measured peak, every rank (see the module's docstring)

# each program's start: the imports under test, and the resident MiB of the process
_PROGRAM = """
import os
import torch
{imports}
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
"""

# frees an 8 MiB block (glibc as left raises its threshold to it), then holds 100 x 1 MiB, frees all but the last
# (the heap's top stays in use) and prints the resident MiB kept
_KEPT = _PROGRAM + """
big = torch.ones(2 * 2**20)  # 8 MiB, freed
del big
before = rss()
blocks = [torch.ones(2**18) for _ in range(100)]  # 100 x 1 MiB, touched
last = blocks.pop()
del blocks
print(rss() - before)
"""


def _kept_mib(imports: str, program: str = _KEPT, **env: str) -> float:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environment.update(env, ZEROPLUS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-c", program.format(imports=imports)], env=environment, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1])


def test_import_zeroplus_makes_glibc_return_what_is_freed():
    kept_plain = _kept_mib("")
    kept_keep = _kept_mib("import zeroplus", ZEROPLUS_HOST_ALLOCATOR="keep")
    kept_zeroplus = _kept_mib("import zeroplus")
    assert kept_plain > 90 and kept_keep > 90, (kept_plain, kept_keep)  # glibc as left keeps the 99 freed MiB
    assert kept_zeroplus < 10, kept_zeroplus


# 1000 blocks of 96 KiB (a bf16 activation of 64 tokens at width 768), each followed by a small block that stays
# (what a step leaves alive: an autograd node, a scalar); frees the large ones and prints the resident MiB kept
_HOLES = _PROGRAM + """
before = rss()
blocks, kept = [], []
for _ in range(1000):
    blocks.append(torch.ones(24576))  # 96 KiB, touched
    kept.append(torch.ones(8))
del blocks
print(rss() - before)
"""


def test_blocks_freed_below_live_ones_go_back():
    """A freed block glibc took from the heap stays resident while a live block sits above it; blocks of 32 KiB and
    more are mapped apart (``THRESHOLD``), so only smaller ones can leave such holes. At 128 KiB this kept 96 MiB
    (a bf16 rank's activations at 64 tokens of width 768 are 96 KiB)."""
    kept_plain = _kept_mib("", _HOLES)
    kept_zeroplus = _kept_mib("import zeroplus", _HOLES)
    assert kept_plain > 80, kept_plain  # glibc as left keeps the holes
    assert kept_zeroplus < 10, kept_zeroplus


# the module alone (it imports nothing of zeroplus or torch), settled as ``import zeroplus`` settles it: a process
# started in a second, where importing zeroplus takes five
_ALONE = ("import importlib.util as u; spec = u.spec_from_file_location('host_allocator', "
          "'zeroplus/host_allocator.py'); h = u.module_from_spec(spec); spec.loader.exec_module(h); ")


def test_keep_is_said_beside_the_prediction_and_a_bad_value_is_named():
    """(The bad value through ``import zeroplus`` itself: it refuses it there.)"""
    program = _ALONE + "h.settle(h.mode_from_env()); print(h.caveat())"
    environment = dict(os.environ, ZEROPLUS_ACCELERATOR="cpu", ZEROPLUS_HOST_ALLOCATOR="keep")
    done = subprocess.run([sys.executable, "-c", program], env=environment, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "ZEROPLUS_HOST_ALLOCATOR=keep" in done.stdout, done.stderr[-2000:]
    environment["ZEROPLUS_HOST_ALLOCATOR"] = "sometimes"
    done = subprocess.run([sys.executable, "-c", "import zeroplus"], env=environment, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "ZEROPLUS_HOST_ALLOCATOR='sometimes'" in done.stderr


def test_a_users_threshold_above_zeroplus_is_said_beside_the_prediction():
    """A process started with ``MALLOC_*`` variables keeps them; where they leave an mmap threshold above zeroplus's
    32 KiB (set, or glibc's own 128 KiB where only the trim threshold is set) the prediction says so; at or under
    32 KiB it says nothing."""
    program = _ALONE + "print(h.settle(h.mode_from_env()), h.caveat())"
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    said = {}
    for name, env in {"above": {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"},
                      "trim only": {"MALLOC_TRIM_THRESHOLD_": "32768"},
                      "at ours": {"MALLOC_MMAP_THRESHOLD_": "32768", "MALLOC_TRIM_THRESHOLD_": "32768"}}.items():
        done = subprocess.run([sys.executable, "-c", program], env={**base, **env, "ZEROPLUS_ACCELERATOR": "cpu"},
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        said[name] = done.stdout.strip()
    assert said["above"].startswith("user ") and "MALLOC_MMAP_THRESHOLD_=131072" in said["above"], said
    assert "under 128 KiB" in said["above"] and "glibc's own mmap threshold" in said["trim only"], said
    assert said["at ours"] == "user None", said


def _matrix():
    spec = importlib.util.spec_from_file_location("bench_matrix", os.path.join(ROOT, "bench", "bench_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model,optimizer", [("own", "client"), ("nn", "config")])
def test_the_matrix_corners_are_predicted_within_the_tolerance_with_glibc_as_left(model, optimizer):
    matrix = _matrix()
    cell = {"models": model, "dtypes": "fp32", "allocs": "left", "optimizers": optimizer, "overlap": "false",
            "ranks": "2", "batches": "2x64", "scale": "test"}
    for _ in range(2):
        result = matrix.launch("zeroplus", cell)
        assert "failed" not in result, result["failed"]
        if all(abs(e) <= TOLERANCE for e in result["errors"]):
            break
    assert all(abs(e) <= TOLERANCE for e in result["errors"]), result
    # the ledger at the peak, which names why a cell is over the lead's target: ZeRO-3 over 2 ranks holds half the
    # fp32 masters (4 bytes a parameter) and twice that of Adam's moments
    params = sum(p.numel() for p in matrix.build(model, 64, "test").parameters())
    held = result["ledger_at_peak"]
    assert held["master"] == pytest.approx(4 * params / 2, rel=0.01), held
    assert held["optim_state"] == 2 * held["master"], held
    # a cell over the target (FSDP2's best set to zeroplus's own peak: 1.00x) is listed with that reason
    key = matrix.fsdp_key(cell)
    records = [{"engine": "zeroplus", "key": key, "cell": cell, "result": result}] + [
        {"engine": "fsdp2", "key": matrix.fsdp_key({**cell, "allocs": a}), "cell": {**cell, "allocs": a},
         "result": {"peak": result["peak"], "step": 1.0}} for a in ("left", "return")]
    listed = matrix.table(records).split("cells over the target")[1]
    assert "1.00x; model states" in listed and f"master {held['master'] / 2**20:.0f}" in listed, listed
