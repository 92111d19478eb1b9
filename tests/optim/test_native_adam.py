"""The one-pass CPU loop of Adam/AdamW over stored moments (``kernels/native_adam.py``, ``adam_stored.c``).

- Built and loaded on this machine (a C compiler is present wherever the suite runs; skipped, with the reason,
  where none is), and used by the stored-states optimizer for CPU parameters.
- Against torch's fused kernel in one process, bit for bit: Adam and AdamW, decay on and off, ``maximize``, a
  ``grad_scale`` (the gradient divided and stored back), bf16, fp16 (a tile at a time), fp32, fp8 (fp32 scales per
  128 and per 256: each block size its own compiled loop) and mxfp8 (e8m0 per 32) moments, rounded to nearest and
  stochastically, six steps, tensors whose length leaves a tail (which torch's kernel then takes, with the fp8 block
  it is in): the stored-states optimizer with the loop equals the same optimizer without it (the chunked step:
  torch's kernel around fp32 copies), moments, scales and parameters, on one thread and on two.
- An overflow step (``found_inf`` set) changes nothing, as torch's kernel.
- The guard: a loop whose arithmetic differs from torch's (the second moment's fused multiply-add written as a
  multiply and an add) is refused at load, naming what differs (the optimizer then runs the chunked step).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import zeroplus
from tests.models import ParityNet, make_batches
from zeroplus.cache_dir import cache_root
from zeroplus.kernels import native_adam
from zeroplus.kernels.block_fp8 import E4M3, E8M0, MX_BLOCK, dequantize_into
from zeroplus.optim.stored_states import StoredStatesAdam, StoredStatesAdamW

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here: the chunked step runs")


def _native() -> native_adam.NativeAdam:
    directory = os.path.join(cache_root(), "native")
    kernel = native_adam.load(directory)
    assert kernel is not None, native_adam.unavailable(directory)
    return kernel


def _pair(cls: type, params: list[torch.Tensor], **kwargs) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer,
                                                                      list[torch.Tensor], list[torch.Tensor]]:
    ours = [p.detach().clone().requires_grad_() for p in params]
    chunked = [p.detach().clone().requires_grad_() for p in params]
    a, b = cls(ours, fused=True, **kwargs), cls(chunked, fused=True, **kwargs)
    b.native = None
    return a, b, ours, chunked


@needs_compiler
@pytest.mark.fast
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cls,decay,maximize,scaled", [
    (StoredStatesAdamW, 0.1, False, False), (StoredStatesAdam, 0.1, False, True), (StoredStatesAdamW, 0.0, True, False),
])
@pytest.mark.parametrize("moments,rounding", [("bf16", "nearest"), ("bf16", "stochastic"), ("mixed", "nearest"),
                                              ("fp16", "nearest"), ("fp16-bf16", "nearest"),
                                              ("fp8", "stochastic"), ("fp8", "nearest"), ("fp8-256", "stochastic"),
                                              ("mxfp8", "stochastic")])
def test_the_loop_equals_the_chunked_step_bit_for_bit(cls, decay, maximize, scaled, moments, rounding, threads):
    kernel = _native()
    dtypes = {"bf16": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
              "mixed": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.float32},
              "fp16": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16},
              "fp16-bf16": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.bfloat16},
              "fp8": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": E4M3},
              "fp8-256": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": E4M3, "block": 256},
              "mxfp8": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": E4M3, "block": MX_BLOCK, "scale_dtype": E8M0},
              }[moments]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) * 0.1 for n in (4099, 3 * kernel.lanes, 7, 1 << 14, 128 * 5 + 3)]
    a, b, ours, chunked = _pair(cls, params, lr=1e-2, weight_decay=decay, maximize=maximize, rounding=rounding,
                                **dtypes)
    assert a.native is kernel and a.workspace_bytes < b.workspace_bytes
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(6):
            grads = [torch.randn(p.shape, generator=gen) for p in params]
            for opt, group in ((a, ours), (b, chunked)):
                for p, g in zip(group, grads):
                    p.grad = g.clone()
                if scaled:
                    opt.grad_scale = torch.tensor(2.0 ** (step % 3))
                opt.step()
            for x, y in zip(ours + [p.grad for p in ours], chunked + [p.grad for p in chunked]):
                assert torch.equal(x, y), (step, x.numel())
    finally:
        torch.set_num_threads(before)
    for p, q in zip(ours, chunked):
        assert a.state[p].keys() == b.state[q].keys()
        for key in a.state[p]:
            assert a.state[p][key].dtype == b.state[q][key].dtype
            assert torch.equal(_bits(a.state[p][key]), _bits(b.state[q][key])), key


@needs_compiler
@pytest.mark.fast
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("loop", [True, False])
@pytest.mark.parametrize("moments", ["fp8", "fp8-256", "mxfp8"])
def test_gradient_segments_step_as_their_gathered_tensor(moments, loop, threads):
    """One rank's kept gradients handed to the step as segments of a flat parameter (``GradientSegments``: gaps of
    zeros between them and after the last, blocks that span two, a segment inside one block, a ``grad_scale``):
    parameter, moments and scales bit for bit the step over their gathered tensor, with the loop (each block read
    where it is) and without it (the chunked step gathers a chunk at a time)."""
    kernel = _native()
    dtypes = {"fp8": {}, "fp8-256": {"block": 256}, "mxfp8": {"block": MX_BLOCK, "scale_dtype": E8M0}}[moments]
    gen = torch.Generator().manual_seed(0)
    layout = [(0, 100), (100, 300), (450, 1000), (1500, 37), (1600, 3000), (4700, 5)]  # (offset, numel)
    numel = 4800 + 2 * kernel.lanes + 3
    flat = torch.randn(numel, generator=gen) * 0.1
    ours, ref = flat.clone().requires_grad_(), flat.clone().requires_grad_()
    opts = [StoredStatesAdamW([p], fused=True, lr=1e-2, weight_decay=0.1, exp_avg_dtype=E4M3, exp_avg_sq_dtype=E4M3,
                              rounding="stochastic", **dtypes) for p in (ours, ref)]
    opts[0].takes_gradient_segments = True
    if not loop:
        opts[0].native = None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(4):
            tensors = [torch.randn(n, generator=gen) for _, n in layout]
            segments = native_adam.GradientSegments(tensors, [o for o, _ in layout], numel)
            ref.grad = segments.gather(0, numel, torch.empty(numel))
            scale = torch.tensor(2.0 ** (step % 3))
            for opt in opts:
                opt.grad_scale = scale
            with opts[0].given({ours: segments}):
                opts[0].step()
            opts[1].step()
            assert torch.equal(ours, ref), step
    finally:
        torch.set_num_threads(before)
    assert ours.grad is None and opts[0].state[ours].keys() == opts[1].state[ref].keys()
    for key in opts[1].state[ref]:
        assert torch.equal(_bits(opts[0].state[ours][key]), _bits(opts[1].state[ref][key])), key


def test_gradient_segments_out_of_order_are_refused():
    with pytest.raises(ValueError, match="ascending, apart and within it"):
        native_adam.GradientSegments([torch.zeros(10), torch.zeros(10)], [0, 5], 100)
    with pytest.raises(ValueError, match="ascending, apart and within it"):
        native_adam.GradientSegments([torch.zeros(10)], [95], 100)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@needs_compiler
def test_an_overflow_step_changes_nothing():
    _native()
    params = [torch.randn(1000)]
    a, _, ours, _ = _pair(StoredStatesAdamW, params, lr=1e-2, exp_avg_dtype=torch.bfloat16,
                          exp_avg_sq_dtype=torch.bfloat16)
    ours[0].grad = torch.randn(1000)
    a.step()
    kept = (ours[0].detach().clone(), a.state[ours[0]]["exp_avg"].clone(), a.state[ours[0]]["step"].clone())
    a.found_inf = torch.tensor(1.0)
    a.grad_scale = torch.tensor(4.0)
    grad = torch.randn(1000)
    ours[0].grad = grad.clone()
    a.step()
    assert torch.equal(ours[0], kept[0]) and torch.equal(a.state[ours[0]]["exp_avg"], kept[1])
    assert torch.equal(a.state[ours[0]]["step"], kept[2]) and torch.equal(ours[0].grad, grad)


def _fp8_values(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    state = opt.state[p]
    return {key: dequantize_into(torch.empty(p.numel()), state[key], state[f"{key}_scale"], 128)
            for key in ("exp_avg", "exp_avg_sq")}


@needs_compiler
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_an_overflow_step_leaves_fp8_moments_as_they_were(rounding: str) -> None:
    """fp8 moments, a block whose largest code is 224 (half the top of e4m3's range): an overflow step stores nothing
    where the native loop is built (the states' bytes as they were), and elsewhere (the chunked step, as on a device)
    leaves their values as they were, though it stores the moments again from them (that block then at half its scale
    with twice its codes)."""
    _native()
    a, b, ours, chunked = _pair(StoredStatesAdamW, [torch.randn(512)], lr=1e-2, exp_avg_dtype=E4M3,
                                exp_avg_sq_dtype=E4M3, rounding=rounding)
    for opt, p in ((a, ours[0]), (b, chunked[0])):
        p.grad = torch.randn(512)
        opt.step()
        for key in ("exp_avg", "exp_avg_sq"):  # block 0: codes of 1 and one of 224, its scale 2^-10
            opt.state[p][key][:128] = torch.tensor([224.0] + [1.0] * 127).to(E4M3)
            opt.state[p][f"{key}_scale"][0] = 2.0 ** -10
    kept = {key: value.clone() for key, value in a.state[ours[0]].items()}
    values = _fp8_values(b, chunked[0])
    for opt, p in ((a, ours[0]), (b, chunked[0])):
        opt.found_inf = torch.tensor(1.0)
        opt.grad_scale = torch.tensor(1.0)
        weight = p.detach().clone()
        p.grad = torch.randn(512)
        opt.step()
        assert torch.equal(p, weight)
    assert all(torch.equal(_bits(a.state[ours[0]][key]), _bits(kept[key])) for key in kept), rounding
    assert all(torch.equal(v, values[key]) for key, v in _fp8_values(b, chunked[0]).items())


@needs_compiler
def test_the_engine_steps_bf16_moments_with_the_loop_on_the_cpu():
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
        "zeroplus": {"log_level": "warning", "memory_estimate": False,
                     "optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "bf16"}}})
    assert engine.optimizer.native is _native()
    for x, y in make_batches(2, 2):
        engine.backward(engine(x, y))
        engine.step()
    engine.destroy()


@needs_compiler
def test_a_loop_that_differs_from_torchs_kernel_is_refused(tmp_path, monkeypatch):
    with open(native_adam.SOURCE) as f:
        source = f.read()
    exact = "v = fmaf(sq_coeff * g, g, v * beta2);"
    assert source.count(exact) == 1
    mutated = tmp_path / "adam_stored.c"
    mutated.write_text(source.replace(exact, "v = v * beta2 + sq_coeff * g * g;"))
    monkeypatch.setattr(native_adam, "SOURCE", str(mutated))
    directory = str(tmp_path / "built")
    assert native_adam.load(directory) is None
    assert "differs from torch's fused kernel" in native_adam.unavailable(directory)
