"""FLOPs and MFU: ``"flops_profiler"``.

In one process, a stack of three bias-free ``Linear`` layers trains with the profiler on. The FLOPs torch's
counter saw on the real step equal the textbook count of its matrix products (each layer's forward ``2 T i o``
for ``T`` tokens, backward the weight's gradient ``2 T i o`` and, for every layer but the first, whose input
needs no gradient, the input's ``2 T i o``); the profile splits forward and backward that way, lists each
layer's forward FLOPs and goes to ``output_file``; a report after later steps gives TFLOP/s and the MFU
against ``zeroplus.peak_tflops``. The peak table finds the parts it names. On CPU the peak is timed in a child
process and kept: the training process does not hold the products' 12 MiB (in-process they stayed above a small
model's predicted peak: the main job's memory line read 2.5 MiB over).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus
from zeroplus.accelerator import Accelerator
from zeroplus.engine.flops_profiler import known_peak, measured_cpu_peak

SIZES = [(16, 32), (32, 24), (24, 16)]
TOKENS = 2 * 5


class _Linears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in SIZES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x, y)


@pytest.mark.fast
def test_the_counted_flops_are_the_steps_matrix_products_and_give_an_mfu(tmp_path):
    out = tmp_path / "profile.txt"
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "steps_per_print": 3, "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(out),
                                                    "module_depth": 2, "top_modules": 3},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "peak_tflops": 1.5}}
    engine = zeroplus.initialize(_Linears(), cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        engine.backward(engine(torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)))
        engine.step()
    products = [2 * TOKENS * i * o for i, o in SIZES]
    forward, backward = sum(products), sum(products) + sum(products[1:])
    profiler = engine.flops
    assert profiler.flops_per_step == forward + backward and profiler.forward_flops == forward
    assert profiler.modules["layers.0"] == products[0] and profiler.modules["layers.2"] == products[2]
    assert profiler.params == profiler.trained == sum(i * o for i, o in SIZES)
    text = out.read_text()
    assert "step 2" in text and "layers.1" in text and "zeroplus.peak_tflops" in text, text
    report = profiler.last
    assert report["flops_per_step"] == forward + backward and report["tflops"] > 0
    assert report["mfu"] == pytest.approx(report["tflops"] / 1.5)


_tanh = torch.compile(torch.tanh)  # a compiled helper inside a model (a user's, or zeroplus.fused_ops "compiled")


class _CompiledInside(_Linears):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _tanh(layer(x))
        return F.mse_loss(x, y)


def test_a_compiled_function_inside_the_model_is_compiled_after_the_counted_step():
    """The counted step runs under torch's ``FlopCounterMode``, a dispatch mode, and the first training forward
    under the activation census, another: TorchDynamo refuses a frame under one and remembers it, so the helper
    ran eagerly for the whole run until both went through ``force_eager``."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "flops_profiler": {"enabled": True, "profile_step": 2},
           "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(_CompiledInside(), cfg)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 5, 16), torch.randn(2, 5, 16)))
        engine.step()
    assert engine.flops.flops_per_step and counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])


def test_the_peak_table_knows_the_parts_it_names():
    assert known_peak("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.5
    assert known_peak("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5
    assert known_peak("Ascend910B3", torch.float16) == 313.0
    assert known_peak("Some Future Part", torch.bfloat16) is None


def test_the_cpu_peak_is_timed_in_a_child_process_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROPLUS_CACHE_DIR", str(tmp_path))
    accel = Accelerator()  # the CPU one: resident memory and its peak
    accel.reset_peak_memory_stats()
    before = accel.memory_allocated()
    peak = measured_cpu_peak(torch.float32, n=1024, repeats=2)
    rose = accel.max_memory_allocated() - before
    assert peak > 0
    assert rose < 4 * 2**20, f"timing the peak raised this process's peak by {rose} B (its matrices: 12 MiB)"
    kept = list(tmp_path.glob("cpu-peak-*.json"))
    assert len(kept) == 1, kept
    assert measured_cpu_peak(torch.float32, n=1024, repeats=2) == peak  # read back, not timed again
