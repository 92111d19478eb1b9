"""The runtime overhead is measured on this machine by a child process, kept in a file, read back by
later processes, and can be set by hand; on CUDA/NPU it is 0. A process that already holds torch's
training code (it trained something before) is predicted without what it paid."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroplus.budget import runtime_overhead
from zeroplus.budget.runtime_overhead import (
    ENV,
    block_scaled_states_bytes,
    kernel_cache_bytes,
    runtime_bytes,
    second_simulation_bytes,
)
from zeroplus.config import ConfigError
from zeroplus.cpu_precision import native_bf16


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("ZEROPLUS_CACHE_DIR", str(tmp_path))
    runtime_overhead._measured.cache_clear()
    yield tmp_path
    runtime_overhead._measured.cache_clear()


@pytest.fixture
def suite_probe(monkeypatch, suite_cache_dir):
    """The run's own cache (tests/conftest.py): the probe runs here once per dtype, in this test or in whichever test
    of the run first needed the budget, never measured by an earlier run."""
    monkeypatch.delenv(ENV, raising=False)
    runtime_overhead._measured.cache_clear()
    yield Path(suite_cache_dir)
    runtime_overhead._measured.cache_clear()


def test_measured_once_per_compute_dtype_kept_and_read_back(suite_probe, monkeypatch):
    """Probed once per compute dtype: a bf16 run loads kernels an fp32 run does not (12 MiB more here), so it is
    probed and kept on its own; a later process reads what was kept."""
    construction, training = runtime_bytes("cpu")
    bf16 = runtime_bytes("cpu", "bf16")
    assert (construction, training) != bf16 and 0 < bf16[1] < 2**30
    kept = sorted(json.loads(p.read_text())["dtype"] for p in suite_probe.glob("runtime-overhead-*.json"))
    assert kept == ["bf16", "fp32"]
    with pytest.raises(ValueError, match="dtype 'float32' is not one of"):
        runtime_bytes("cpu", "float32")
    # kernel libraries and autograd's thread; not torch._dynamo (tens of MiB), which came with zeroplus (construction
    # read 1.8 MiB on this 2-core machine on 2026-12-02, training more)
    assert 2**20 < construction <= training < 60 * 2**20
    (record,) = [r for r in (json.loads(p.read_text()) for p in suite_probe.glob("runtime-overhead-*.json"))
                 if r["dtype"] == "fp32"]
    assert (record["construction"], record["training"]) == (construction, training)
    assert {"host", "python", "torch", "zeroplus", "probe"} <= set(record)
    paged_in = record["code_trained"] - record["code_built"]
    assert paged_in > 5 * 2**20, "a fresh process pages torch's training code in"
    # a process holding that code already is predicted without it; one holding less, with what it lacks (never below
    # 0: on a 2-core Intel Xeon on 2026-12-07 the probe's training paged in 21.7 MiB of code and held 16.3 MiB more)
    assert runtime_bytes("cpu", code=record["code_trained"]) == (
        max(0, construction - (record["code_constructed"] - record["code_built"])), max(0, training - paged_in))
    assert runtime_bytes("cpu", code=record["code_built"]) == (construction, training)
    assert runtime_bytes("cpu", code=0) == (construction, training)

    def no_second_probe() -> tuple[int, int]:
        raise AssertionError("the kept measurement was not read")
    monkeypatch.setattr(runtime_overhead, "probe", no_second_probe)
    runtime_overhead._measured.cache_clear()
    assert runtime_bytes("cpu") == (construction, training) and runtime_bytes("cpu", "bf16") == bf16
    # a rank with a peer: what the probe's two ranks held beyond its one (gloo's buffers; 1.9-2.0 MiB here alone, and
    # 0 once under the suite's two workers, 2026-12-04: the pair's run read no more than the one rank's)
    assert 0 <= record["peers"] < 16 * 2**20
    assert runtime_bytes("cpu", world_size=2) == runtime_bytes("cpu", world_size=4) == (
        construction, training + record["peers"])
    # a step under the FLOPs profiler (the main job profiles one): what it put on the probe's peak, more in a rank of
    # two (Python dispatch around the collectives; 0.2 MiB alone and 1.2 MiB with a peer here on 2026-12-03)
    assert 0 <= record["profiled"] <= record["profiled_with_peer"] < 16 * 2**20, record
    assert runtime_bytes("cpu", profiled=True) == (construction, training + record["profiled"])
    assert runtime_bytes("cpu", world_size=2, profiled=True) == (
        construction, training + record["peers"] + record["profiled_with_peer"])
    assert runtime_bytes("cuda") == runtime_bytes("npu") == runtime_bytes("cuda", world_size=8) == (0, 0)
    # one more simulation of the first forward's estimate (an engine that simulates twice holds it): 0.06 MiB here on
    # 2026-12-03, inside the spread of training between runs (about 0.3 MiB), so it may read 0
    assert 0 <= record["second_simulation"] < 8 * 2**20, record
    assert second_simulation_bytes("cpu") == record["second_simulation"]
    assert second_simulation_bytes("cuda") == second_simulation_bytes("npu") == 0
    # full kernel caches (host_kernel_cache.py): fp32's products are MKL's and keep none (0.1 MiB here on 2026-12-05);
    # bf16's oneDNN kernels, 128 of them, 49 MiB here
    (bf16_record,) = [r for r in (json.loads(p.read_text()) for p in suite_probe.glob("runtime-overhead-*.json"))
                      if r["dtype"] == "bf16"]
    assert 0 <= record["kernel_cache"] < 4 * 2**20, record
    assert kernel_cache_bytes("cpu") == record["kernel_cache"]
    assert kernel_cache_bytes("cpu", "bf16") == bf16_record["kernel_cache"]
    if native_bf16():
        assert 16 * 2**20 < bf16_record["kernel_cache"] < 160 * 2**20, bf16_record
    assert kernel_cache_bytes("cuda", "bf16") == kernel_cache_bytes("npu", "bf16") == 0
    # the code an fp8 and an mxfp8 optimizer step page in beyond training's (2.7-2.9 MiB here on 2026-12-06: the main
    # job with mxfp8 moments read -5.3% without it, -0.8% with it)
    assert 2**19 < record["block_scaled_states"] < 16 * 2**20, record
    assert block_scaled_states_bytes("cpu") == record["block_scaled_states"]
    assert block_scaled_states_bytes("cuda") == block_scaled_states_bytes("npu") == 0


def test_set_by_hand(fresh, monkeypatch):
    monkeypatch.setenv(ENV, "80MiB, 104857600")
    assert runtime_bytes("cpu") == (80 * 2**20, 100 * 2**20)
    assert not list(fresh.iterdir())  # nothing probed, nothing kept
    for bad, says in (("12", "give two sizes"), ("1MiB,lots", "'lots'")):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises((ValueError, ConfigError), match=f"{ENV}.*{says}"):
            runtime_bytes("cpu")


FIRST_USE = """
import json, torch, zeroplus
from zeroplus.budget.first_use import code_resident
from zeroplus.models import GPT, gpt_config
before = code_resident()
model = GPT(gpt_config("tiny"))
ids = torch.randint(0, 200, (2, 32))
model(ids, ids).backward()
torch.optim.AdamW(model.parameters()).step()
print(json.dumps([before, code_resident(), code_resident()]))
"""


def test_a_process_that_trained_holds_torchs_code_and_reading_it_costs_nothing():
    done = subprocess.run([sys.executable, "-c", FIRST_USE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **runtime_overhead.ALLOCATOR_ENV})
    before, after, again = json.loads(done.stdout.strip().splitlines()[-1])
    assert after - before > 5 * 2**20, (before, after)  # a first training step pages torch's code in
    assert abs(again - after) < 2**20, "reading it pages nothing in"


def test_a_config_that_profiles_a_step_is_predicted_with_what_the_profiled_step_held(monkeypatch):
    """``flops_profiler`` on (the main job turns it on): the estimate's training phases carry the probe's profiled
    figure, in a rank of two its ``profiled_with_peer``; construction does not (MKL's pool beside them is the
    model's own: ``test_host_gemm_pool.py``)."""
    import zeroplus
    from zeroplus.models import GPT, gpt_config
    monkeypatch.delenv(ENV, raising=False)
    mib = 2**20
    measured = (mib, 8 * mib, 0, 0, 0, 2 * mib, 3 * mib, 5 * mib, 0, 0, 7 * mib)
    monkeypatch.setattr(runtime_overhead, "_measured", lambda dtype: measured)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    runtimes = {}
    for world in (1, 2):
        for profiled in (False, True):
            budget = zeroplus.estimate(lambda: GPT(gpt_config("tiny")), {**config, "flops_profiler": {
                "enabled": profiled}}, world_size=world, seq_len=16, accelerator="cpu")
            runtimes[world, profiled] = (budget.phases["init"]["runtime"],
                                         budget.phases[budget.training_peak_phase]["runtime"] - budget.host_buffers)
    assert runtimes[1, False] == (mib, 8 * mib) and runtimes[1, True] == (mib, 11 * mib), runtimes
    assert runtimes[2, False] == (mib, 10 * mib) and runtimes[2, True] == (mib, 15 * mib), runtimes
    # fp8 or mxfp8 moments: their step's code (the probe's block_scaled_states) from the first step on; bf16's, none
    for moments, more in (("fp8", 7 * mib), ("mxfp8", 7 * mib), ("bf16", 0)):
        budget = zeroplus.estimate(lambda: GPT(gpt_config("tiny")), {**config, "zeroplus": {"optimizer_states": {
            "exp_avg": moments, "exp_avg_sq": moments}}}, world_size=1, seq_len=16, accelerator="cpu")
        assert (budget.phases["init"]["runtime"], budget.phases[budget.training_peak_phase]["runtime"]
                - budget.host_buffers) == (mib, 8 * mib + more), moments
