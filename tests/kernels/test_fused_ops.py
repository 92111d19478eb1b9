"""The fused operators (``kernels/swiglu.py``, ``rms_norm.py``, ``grouped_gemm.py``, ``rotary.py``) against their
reference twins, and ``zeroplus.fused_ops`` installed in Hugging Face Llama and Qwen2 models through the config.

Covers: SwiGLU and RMSNorm values and gradients bitwise equal to eager autograd in fp32 and bf16 (odd widths,
a weight that needs no gradient), with fewer bytes kept for backward (counted by saved-tensor hooks); the
grouped expert product equal to the per-expert loop with an empty expert, gradients included; the rotary
reference equal to Hugging Face's own function; a tiny Llama and Qwen2 trained 3 steps through
``initialize`` with ``zeroplus.fused_ops`` equal to the same engine without it, losses and weights bit for bit;
``"compiled"``: the compiled references run and train a tiny Llama in fp32 as eager to fp32 rounding; the key
refused in a model with nothing to fuse; ``"fastest"`` picks each device's kernels, ``"liger"`` is refused off
CUDA or without the package (Liger itself runs in tests/device).
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.hf_models import LossOf, build
from tests.models import ParityNet
from zeroplus.config import ConfigError
from zeroplus.fused_ops import KERNELS, LIGER, compiled_kernels, install, kernels_for
from zeroplus.kernels import liger
from zeroplus.kernels.grouped_gemm import grouped_mm, grouped_mm_reference
from zeroplus.kernels.rms_norm import rms_norm, rms_norm_reference
from zeroplus.kernels.rotary import rotary_reference
from zeroplus.kernels.swiglu import swiglu, swiglu_reference

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def _saved_bytes(fn, *args) -> tuple[torch.Tensor, int]:
    """``fn(*args)`` and the bytes of the distinct storages autograd keeps for its backward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(storages.values())


def _run(fn, inputs: list[torch.Tensor], grad: torch.Tensor, *extra) -> tuple[torch.Tensor, list, int]:
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out, saved = _saved_bytes(fn, *leaves, *extra)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves if t.requires_grad], saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_rms_norm_equal_eager_bitwise_and_keep_less(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up, dy = (torch.randn(3, 7, 45, generator=g).to(dtype).requires_grad_() for _ in range(3))
    ref = _run(swiglu_reference, [gate, up], dy.detach())
    got = _run(swiglu, [gate, up], dy.detach())
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    assert got[2] == 2 * gate.numel() * gate.element_size() < ref[2]  # gate and up; eager adds silu(gate)

    x, dy = (torch.randn(3, 7, 45, generator=g).to(dtype) for _ in range(2))
    for needs_weight in (True, False):
        weight = (1 + 0.1 * torch.randn(45, generator=g)).to(dtype).requires_grad_(needs_weight)
        ref = _run(rms_norm_reference, [x.requires_grad_(), weight], dy, 1e-6)
        got = _run(rms_norm, [x, weight], dy, 1e-6)
        assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
        assert got[2] == x.numel() * x.element_size() + weight.numel() * weight.element_size() < ref[2]


def test_grouped_products_equal_the_per_expert_loop_with_an_empty_expert():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, 24, generator=g, requires_grad=True)
    ends = torch.tensor([5, 5, 20, 37], dtype=torch.int32)  # expert 1 gets no rows
    dy = torch.randn(37, 24, generator=g)
    ref = grouped_mm_reference(x, w, ends)
    ref_grads = torch.autograd.grad(ref, (x, w), dy)
    got = grouped_mm(x, w, ends)
    assert torch.equal(got, ref)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (x, w), dy), ref_grads))
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(grouped_mm(x, w, ends).sum(), (x, w)),
                                                 torch.autograd.grad(grouped_mm_reference(x, w, ends).sum(), (x, w))))


def test_rotary_reference_is_hugging_faces():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    cos, sin = torch.randn(2, 9, 16, generator=g), torch.randn(2, 9, 16, generator=g)
    for a, b in zip(rotary_reference(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(a, b)


def _train(family: str, fused: bool | str, steps: int = 3, bf16: bool = True) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = LossOf(build(family))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
           "zeroplus": {"log_level": "warning", "fused_ops": fused}}
    engine = zeroplus.initialize(model, cfg)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 24), generator=g)
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.memory_report().predicted_peak_bytes is not None, "the memory estimate failed with fused_ops"
    state = engine.consolidated_fp32_state()
    engine.destroy()
    patched = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert patched == [], f"destroy() left fused forwards on {patched}"  # the model runs eager again
    return losses, state


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_ops_train_a_hugging_face_model_bit_for_bit(family):
    assert len(install(build(family), "cpu")[0]) == 2 * 3 + 1  # per layer two norms and the MLP; the final norm
    plain, fused = _train(family, False), _train(family, True)
    assert fused[0] == plain[0]
    assert all(torch.equal(fused[1][name], value) for name, value in plain[1].items())


def test_compiled_fused_ops_train_within_fp32_rounding_of_eager():
    """``fused_ops: "compiled"``: the compiled references are what runs (graphs captured, no graph break), and
    a tiny Llama in fp32 trains as eager to fp32 rounding (inductor's fused loops round otherwise)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    plain, compiled = _train("llama", False, bf16=False), _train("llama", "compiled", bf16=False)
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"], dict(counters["stats"])
    torch.testing.assert_close(torch.tensor(compiled[0]), torch.tensor(plain[0]), rtol=1e-5, atol=0)
    # weights to 1e-5 absolute, a hundredth of one Adam step at lr 1e-3: Adam turns a rounding-sized gradient
    # difference near zero into a visible update difference (2e-6 on one element on an AMX CPU)
    for name, value in plain[1].items():
        torch.testing.assert_close(compiled[1][name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("fused", [False, True, "compiled"])
def test_a_norm_running_a_fused_kernel_keeps_what_the_kernel_keeps(fused):
    """Resize recompute claims the intermediates of a norm written out (Llama's RMSNorm, eager) but not of one whose
    forward ``fused_ops`` replaced: a compiled kernel saves what its compilation chose, which differed between the
    forward and the recompute in backward on one H200 (6 tensors against 3, 2026-12-04), and the recompute raised."""
    from zeroplus.activations import ResizeRecompute
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "fused_ops": fused,
                        "resize_recompute": {"enabled": True, "norms": True}}}
    engine = zeroplus.initialize(LossOf(build("llama")), cfg)
    recompute = next(c for c in engine.activations.claimers if isinstance(c, ResizeRecompute))
    norms = [n for n in recompute.targets if n.endswith("norm")]
    assert len(norms) == 2 * 2 + 1 and recompute.written_norms == ([] if fused else norms), recompute.written_norms
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(ids, ids))
    engine.step()
    engine.destroy()


def test_fused_ops_refused_where_nothing_would_change():
    with pytest.raises(ConfigError, match="zeroplus.fused_ops"):
        zeroplus.initialize(ParityNet(), {"train_micro_batch_size_per_gpu": 1, "zeroplus": {"fused_ops": True},
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})


def test_each_device_gets_the_kernels_measured_fastest_there_and_a_choice_it_cannot_run_is_refused():
    """``"fastest"``: the compiled references on the CPU, Liger on CUDA where installed (else compiled), the NPU's
    operators on the NPU; ``"liger"`` refused off CUDA and where the package is missing, naming both; the
    memory estimate's meta model takes the lean kernels whatever was asked."""
    assert kernels_for("cpu", "fastest") == (compiled_kernels(), "compiled references")
    assert kernels_for("npu", "fastest") == (KERNELS["npu"], "kernels")
    assert kernels_for("cuda", "fastest") == ((LIGER, "Liger kernels") if liger.available()
                                              else (compiled_kernels(), "compiled references"))
    assert kernels_for("meta", "liger") == (KERNELS["cpu"], "kernels")
    assert kernels_for("cpu", True) == (KERNELS["cpu"], "kernels")
    with pytest.raises(ConfigError, match=r"'zeroplus.fused_ops' is 'liger'.*CUDA.*this rank's cpu"):
        kernels_for("cpu", "liger")
    with pytest.raises(ConfigError, match=r"'zeroplus.fused_ops' is 'compiled'.*this rank's npu"):
        kernels_for("npu", "compiled")
    if not liger.available():
        with pytest.raises(ConfigError, match=r"'liger'.*'liger_kernel' is not installed"):
            kernels_for("cuda", "liger")
    with pytest.raises(ConfigError, match=r"zeroplus.fused_ops.*liger.*cpu"):  # through the config, before training
        zeroplus.initialize(LossOf(build("llama")), {"train_micro_batch_size_per_gpu": 1,
                                                     "zeroplus": {"fused_ops": "liger"},
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
