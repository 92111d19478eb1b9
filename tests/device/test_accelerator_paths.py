"""The CUDA and Ascend NPU paths, on the device: run where one is present, skipped elsewhere.

Nothing on the CPU machines this project is built on can run these; anyone with one GPU (or NPU) runs them
with ``ZEROPLUS_ACCELERATOR=cuda pytest tests/device`` (``tests/conftest.py`` picks the CPU unless told) or
``bash tests/device/run_on_device.sh`` (the tests and the benchmarks' device rows); two devices add the
reduce-scatter test. One H100 ran them on 2026-11-26 (docs/benchmark.md).
Each compares a mechanism on the device against the same run on the device without it, as the CPU
tests do: stage-3 gathering, prefetch and release against stage 0 (within 1e-5: the same math, other
kernels); optimizer states and parameter shards in pinned host memory and in files (side streams,
events, ``record_stream``) and swap attention, bit for bit against no offload; the ledger against
the device allocator (``max_memory_allocated``); and on two devices ZeRO-3's reduce-scatter
overlapping backward (NCCL/HCCL) against stage 0; the fused operators (bitwise with ``true``, within fp32
rounding compiled or Liger's), the one-rank step bit for bit against the plain module with fused AdamW, and the
lean loss's kernel bit for bit against ``F.cross_entropy``.
``ZEROPLUS_DEVICE_TESTS_ON_CPU=1`` runs the one-device tests on the CPU, which checks the tests, not the
device paths.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zeroplus
from tests.models import ParityNet, make_batches
from zeroplus import fused_ops
from zeroplus.accelerator import get_accelerator
from zeroplus.kernels import liger
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config

ACCEL = get_accelerator()
# ZEROPLUS_DEVICE_TESTS_ON_CPU=1 runs the one-device tests on the CPU: a check of the tests themselves
pytestmark = pytest.mark.skipif(ACCEL.name == "cpu" and os.environ.get("ZEROPLUS_DEVICE_TESTS_ON_CPU") != "1",
                                reason="needs a CUDA or Ascend NPU device and ZEROPLUS_ACCELERATOR=cuda|npu "
                                       "(tests/conftest.py picks the CPU otherwise)")
STEPS = 4


def _config(stage: int, zp: dict | None = None, zero: dict | None = None, dtype: str = "fp32") -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **(zero or {})},
            "zeroplus": {"log_level": "warning", **(zp or {})}}


def _train(model: torch.nn.Module, cfg: dict) -> dict:
    engine = zeroplus.initialize(model, cfg)
    device = ACCEL.device()
    losses = []
    for x, y in make_batches(STEPS, 2):
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ACCEL.synchronize()
    gathered = engine.ledger.peak_bytes(Category.PARAM_GATHERED)  # training's, before consolidating gathers all
    return {"losses": losses, "masters": engine.consolidated_fp32_state(), "engine": engine, "gathered": gathered}


def _parity_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return ParityNet()


def _same(a: dict, b: dict, where: str, exact: bool = True) -> None:
    if exact:
        assert a["losses"] == b["losses"], where
    else:
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5), where
    for name, value in a["masters"].items():
        if exact:
            assert torch.equal(value, b["masters"][name]), f"{where}: {name}"
        else:
            torch.testing.assert_close(value, b["masters"][name], rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")


def test_stage3_gathers_prefetches_and_releases_on_the_device():
    # in bf16: one rank's fp32 stage 3 keeps its parameters resident on the master (nothing to gather)
    plain = _train(_parity_net(), _config(0, dtype="bf16"))
    sharded = _train(_parity_net(), _config(3, zero={"stage3_prefetch_bucket_size": 1}, dtype="bf16"))
    _same(plain, sharded, "stage 3 against stage 0", exact=False)
    engine = sharded["engine"]
    whole = sum(p.numel() * 2 for p in _parity_net().parameters())  # bf16; frozen ones are gathered too
    peak = sharded["gathered"]
    assert 0 < peak < whole, (peak, whole)  # units were gathered, and released before the next ones
    assert engine.ledger.live_bytes(Category.PARAM_GATHERED) < whole  # only the prefetch for the next forward


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offloaded_states_and_parameters_train_identically(tmp_path, device):
    path = str(tmp_path / "tier")
    os.makedirs(path)
    tier = {"device": device, "pin_memory": True, **({"nvme_path": path} if device == "nvme" else {})}
    for stage in (2, 3):
        plain = _train(_parity_net(), _config(stage))
        zero = {"offload_optimizer": dict(tier), "sub_group_size": 64}
        if stage == 3:
            zero["offload_param"] = dict(tier)
        offloaded = _train(_parity_net(), _config(stage, zero=zero))
        # exact on the device; on the CPU (ZEROPLUS_DEVICE_TESTS_ON_CPU) one rank without offload steps per
        # parameter (zero/direct_step.py) and the offloaded step flat, and torch's fused CPU kernels round each
        # tensor's scalar tail an ulp apart, so there the two agree within rounding
        _same(plain, offloaded, f"stage {stage}, {device} tier", exact=ACCEL.name != "cpu")
        assert offloaded["engine"].ledger.live_bytes(Category.OPTIM_STATE) == 0


def test_swap_attention_to_host_changes_no_number():
    torch.manual_seed(0)
    plain = _train(GPT(gpt_config("tiny")), _config(2))
    torch.manual_seed(0)
    swapped = _train(GPT(gpt_config("tiny")), _config(2, zp={"swap_attention": {"enabled": True, "min_bytes": 0},
                                                              "activation_tier": {"device": "host"}}))
    _same(plain, swapped, "swap attention to pinned host memory")


def test_the_ledger_accounts_for_the_device_allocations():
    """After initialize, what the device allocator holds beyond the start is the ledger's live bytes plus
    the model's buffers and frozen parameters (within 1 MiB of allocator rounding)."""
    ACCEL.reset_peak_memory_stats()
    start = ACCEL.memory_allocated()
    engine = zeroplus.initialize(_parity_net(), _config(3, zp={"memory_estimate": False}))
    ACCEL.synchronize()
    held = ACCEL.memory_allocated() - start
    unledgered = sum(t.numel() * t.element_size() for t in engine.module.buffers())
    unledgered += sum(p.numel() * p.element_size() for p in engine.module.parameters() if not p.requires_grad)
    ledger = engine.ledger.total.live_bytes
    assert abs(held - ledger - unledgered) <= 2**20, (held, ledger, unledgered)
    assert engine.ledger.total.peak_bytes <= ACCEL.max_memory_allocated() - start + 2**20


TWO_DEVICE_SCRIPT = """
import json, sys, torch, zeroplus
from tests.models import ParityNet, make_batches
from zeroplus.accelerator import get_accelerator
transport = sys.argv[1] if len(sys.argv) > 1 else "auto"
out = {}
for dtype in ("fp32", "bf16"):
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 500,
                                     "stage3_param_persistence_threshold": 0},
               "zeroplus": {"log_level": "warning", "memory_estimate": False, "transport": transport}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine = zeroplus.initialize(ParityNet(), cfg)
        device, rank = get_accelerator().device(), engine.dp.rank
        losses = []
        for i, (x, y) in enumerate(make_batches(16, 2)):
            if i % 2 == rank:
                loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        out[f"{dtype} {stage}"] = {"losses": losses, "norm": engine.get_global_grad_norm(),
                                   "transport": engine.dp.transport}
        engine.destroy()
if rank == 0:
    print(json.dumps(out))
"""
TWO_DEVICE_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # against stage 0 (bf16: reductions in bf16, another order)


def two_device_parity(out: dict, transport: str) -> None:
    """Every stage's losses and last norm within the dtype's tolerance of stage 0's, on ``transport``."""
    for dtype, rel in TWO_DEVICE_TOLERANCE.items():
        ref = out[f"{dtype} 0"]
        for stage in (0, 1, 2, 3):
            got = out[f"{dtype} {stage}"]
            assert got["transport"] == transport, (dtype, stage, got["transport"])
            assert got["losses"] == pytest.approx(ref["losses"], rel=rel), (dtype, stage)
            assert got["norm"] == pytest.approx(ref["norm"], rel=rel), (dtype, stage)


def _run_two(script: str, *args: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "run", "-n", "2", script, *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.skipif(ACCEL.name != "cpu" and getattr(ACCEL, "module").device_count() < 2,
                    reason="needs two devices")
def test_two_devices_run_the_native_collectives_at_every_stage(tmp_path):
    """NCCL (HCCL) across two devices: stages 0-3 in fp32 and bf16, two micro-batches accumulated, reduce buckets
    smaller than a weight, on the transport ``auto`` takes there (native: one reduce-scatter or all-gather launch
    per collective), every stage's losses and norm within the dtype's tolerance of stage 0's. One launch runs all
    eight. With ``ZEROPLUS_DEVICE_TESTS_ON_CPU=1`` the same script runs on two gloo ranks with ``native`` asked
    for (25 s here): a check of the test itself."""
    script = tmp_path / "two_devices.py"
    script.write_text(TWO_DEVICE_SCRIPT)
    on_cpu = ACCEL.name == "cpu"
    two_device_parity(_run_two(str(script), *(["native"] if on_cpu else [])), "native")


def test_the_breakdown_times_with_device_events_and_the_profiler_finds_the_peak():
    """On a device: ``wall_clock_breakdown`` reads device events (every timer positive, ``bwd_inner`` the
    rest of ``bwd``), and the FLOPs profiler counts the step and takes the device's peak from its table (a known
    GPU) or, for an unknown one, says to set ``zeroplus.peak_tflops``."""
    cfg = _config(3, zp={"memory_estimate": False})
    cfg.update(wall_clock_breakdown=True, steps_per_print=STEPS, flops_profiler={"enabled": True, "profile_step": 2})
    engine = _train(_parity_net(), cfg)["engine"]
    report = engine.timers.last
    assert report["fwd"] > 0 and report["bwd"] > 0 and report["step"] > 0, report
    assert abs(report["bwd_inner"] + report["bwd_allreduce"] - report["bwd"]) < 1e-6, report
    profiler = engine.flops
    assert profiler.flops_per_step and profiler.forward_flops < profiler.flops_per_step
    assert profiler.peak > 0 or "set zeroplus.peak_tflops" in profiler.peak_source, profiler.peak_source
    print(f"{ACCEL.device_name()}: peak {profiler.peak} TFLOP/s ({profiler.peak_source}); breakdown {report}")


@pytest.mark.skipif(ACCEL.name != "cuda", reason="the allocator's history is CUDA's")
def test_out_of_memory_on_the_device_dumps_the_ledger_and_the_allocators_history(tmp_path):
    cfg = _config(3, zp={"memory_estimate": False, "dump_dir": str(tmp_path), "memory_history": True})
    engine = zeroplus.initialize(_parity_net(), cfg)
    x, y = make_batches(1, 2)[0]

    def greedy(module: torch.nn.Module, args: tuple) -> None:
        torch.empty(2 ** 50, device=ACCEL.device())  # more than any device holds
    hook = engine.module.blocks[1].register_forward_pre_hook(greedy)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        engine(x.to(ACCEL.device()), y.to(ACCEL.device()))
    hook.remove()
    note = caught.value.__notes__[0]
    assert "allocator's history" in note and str(tmp_path) in note, note
    assert [f for f in os.listdir(tmp_path) if f.endswith(".pickle")], os.listdir(tmp_path)


def _llama(fused: bool | str, dtype: str = "fp32") -> dict:
    """A tiny Hugging Face Llama trained 3 steps on the device with ``zeroplus.fused_ops`` = ``fused``."""
    from tests.hf_models import LossOf, build
    torch.manual_seed(0)
    engine = zeroplus.initialize(LossOf(build("llama")), _config(2, zp={"fused_ops": fused}, dtype=dtype))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, 256, (2, 24), generator=g).to(ACCEL.device())
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "masters": engine.consolidated_fp32_state()}


def test_fused_operators_train_a_llama_as_eager_does_on_the_device():
    """On a device: ``zeroplus.fused_ops`` (the lean RMSNorm and SwiGLU, which make eager's graph
    again in backward) trains a tiny Hugging Face Llama in bf16 to the same losses and weights as without it,
    bit for bit (the same kernels run; only what is kept for backward differs)."""
    _same(_llama(False, "bf16"), _llama(True, "bf16"), "fused operators against eager")


@pytest.mark.parametrize("choice", ["compiled", pytest.param("liger", marks=pytest.mark.skipif(
    ACCEL.name != "cuda" or not liger.available(), reason="Liger's kernels: CUDA and liger_kernel installed"))])
def test_fused_kernels_train_within_fp32_rounding_of_eager_on_the_device(choice: str):
    """``fused_ops: "compiled"`` (inductor's Triton kernels for the references) and ``"liger"`` (Liger's,
    ``kernels/liger.py``) train a tiny Llama in fp32 to eager's losses and weights within fp32 rounding (other
    kernels, the same math); on CUDA with Liger installed, ``"fastest"`` installs Liger's."""
    from tests.hf_models import LossOf, build
    if choice == "liger":
        assert fused_ops.install(LossOf(build("llama")), "cuda", "fastest")[1] == "Liger kernels"
    # the loss tolerance of tests/kernels/test_fused_ops.py's CPU case; weights to 1e-4 absolute, a hundredth of a
    # step at lr 1e-2: Adam turns a rounding-sized gradient difference near zero into a visible update difference
    # (one H100, 2026-11-27: Liger's SwiGLU left 1 of 8192 gate weights 4.0e-5 from eager's after the steps, the
    # losses within 1e-5; a wrong kernel moves the losses and most weights by whole steps)
    plain, fused = _llama(False), _llama(choice)
    torch.testing.assert_close(torch.tensor(fused["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=0)
    for name, value in plain["masters"].items():
        torch.testing.assert_close(fused["masters"][name], value, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, n=name: f"{choice} fused operators against eager, {n}: {m}")


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_steps_as_the_plain_module_with_fused_adamw_on_the_device(stage: int):
    """On a device: one rank in fp32 keeps autograd's gradients and steps torch's fused AdamW over
    per-parameter views (``zero/direct_step.py``), so it trains as the plain module with
    ``torch.optim.AdamW(fused=True)`` on the device, bit for bit (no clipping)."""
    import copy
    torch.manual_seed(0)
    net = ParityNet()
    plain = copy.deepcopy(net).to(ACCEL.device())
    cfg = _config(stage)
    cfg["gradient_clipping"] = 0.0
    engine = zeroplus.initialize(net, cfg)
    trained = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.01, fused=True)
    device = ACCEL.device()
    for x, y in make_batches(STEPS, 2):
        x, y = x.to(device), y.to(device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        plain(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = engine.consolidated_fp32_state()
    differ = {n: (state[n].cpu() - p.detach().cpu()).abs().max().item() for n, p in plain.named_parameters()
              if p.requires_grad and not torch.equal(state[n].cpu(), p.detach().cpu())}
    assert not differ, f"stage {stage}: not the plain module's (largest difference per parameter): {differ}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_loss_is_torchs_cross_entropy_bit_for_bit_on_the_device(dtype: torch.dtype):
    """The lean loss's kernel (``kernels/cross_entropy_rows.py``, on by default) on the device: the loss and the
    logits' gradient of a 16384-class vocabulary over 1000 tokens (several blocks, the last ragged; ignored rows;
    every reduction) equal ``F.cross_entropy``'s bit for bit, as on the CPU: each ATen operator it calls on a block
    of rows computes a row on its own (the device's softmax kernels pick their launch by the row length)."""
    from zeroplus.kernels.cross_entropy_rows import cross_entropy_rows, reference
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1000, 16384, generator=g) * 4).to(dtype).to(ACCEL.device())
    targets = torch.randint(0, 16384, (1000,), generator=g)
    targets[::7] = -100
    targets = targets.to(ACCEL.device())
    for reduction in ("mean", "sum", "none"):
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        want, got = reference(a, targets, -100, reduction), cross_entropy_rows(b, targets, -100, reduction)
        assert torch.equal(got, want), (dtype, reduction)
        upstream = torch.rand(want.shape, generator=g).to(dtype).to(ACCEL.device()) + 0.5
        want.backward(upstream)
        got.backward(upstream)
        assert torch.equal(b.grad, a.grad), (dtype, reduction)
