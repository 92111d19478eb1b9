"""The estimator's CPU matmul workspace (``budget/tracker.py``'s ``cpu_workspace_bytes``) against what a bf16
matrix product really holds on this CPU: resident memory above its output, measured in a fresh process with
glibc returning freed memory, once as the CPU is and once with oneDNN capped to AVX512_CORE (no bf16
instructions: emulated, an fp32 buffer of the output's size) where the CPU has AVX-512. The head's weight
gradient of a 16384-word vocabulary at d 768 over 1024 tokens (24 MiB out): within 4 MiB.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_MEASURE = """
import json, torch
from zeroplus.budget.tracker import cpu_workspace_bytes
def resident(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
a = torch.randn(1024, 16384).bfloat16().t()
b = torch.randn(1024, 768).bfloat16()
torch.mm(a[:8], b[:, :8])
base = resident("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
out = torch.mm(a, b)
predicted = cpu_workspace_bytes(torch.ops.aten.mm.default, out)
print(json.dumps({"held": resident("VmHWM") - base - out.nbytes, "predicted": predicted}))
"""


def _avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return "avx512f" in f.read()


@pytest.mark.parametrize("cap", [None, "AVX512_CORE"])
def test_the_bf16_matmul_workspace_is_what_this_cpu_holds(cap):
    if cap is not None and not _avx512():
        pytest.skip("oneDNN's AVX512_CORE cap needs an AVX-512 CPU")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", OMP_NUM_THREADS="2")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if cap is not None:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert abs(got["held"] - got["predicted"]) <= 4 << 20, (cap, got)
    if cap is not None:
        assert got["predicted"] == 4 * 16384 * 768  # emulated: an fp32 buffer of the output's size
