"""The activation techniques find their modules by what they compute, whatever their class is called
(``zeroplus/activations/module_roles.py``; see note: modules by what they compute):

- norms: torch's, Hugging Face's ``LlamaRMSNorm``, a LayerNorm or an RMSNorm written out under any name; not a scale
  alone (no reduction), a dropout after a norm (a random draw), a linear layer or an embedding;
- activation functions whose backward keeps their input: GELU, SiLU, Hugging Face's wrapper, a ``tanh`` GELU written
  out; not ReLU or Tanh (they keep their output), a dropout, an identity, a softmax;
- position-wise MLPs: the built-in GPT's, a Llama-style gated one, Hugging Face Llama's, one written with the
  project's own Linear class under another name; not a mixture of experts (its router) or its experts, not two
  linears with nothing between (a low-rank adapter), not a block with attention or norms inside;
- the modules that attend: each model's attention module, or the block where attention is written inline.

The answers are kept from before the partition releases the parameters; swap attention and tiling on a model
whose classes are named nothing like ``*Attention`` / ``*MLP`` run, and give the gradients of the run without them."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus
from tests.memory.test_resize_recompute import Standardise
from tests.models import GELUActivation, LlamaStyleNet, PlainEmbedding, PlainGPT, PlainLayerNorm, PlainLinear
from zeroplus.activations.module_roles import (
    activates,
    attention_modules,
    keeps_intermediates,
    normalises,
    position_wise_mlps,
)
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config


class Root(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.g


class Scale(Root):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


class NoisyNorm(Root):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(super().forward(x), 0.1, True)


def _llama_rms_norm() -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return LlamaRMSNorm(8)


@pytest.mark.parametrize("build,expected", [
    (lambda: nn.LayerNorm(8), True), (lambda: nn.RMSNorm(8), True), (lambda: Root(8), True),
    (lambda: Standardise(8), True), (lambda: PlainLayerNorm(8), True), (_llama_rms_norm, True),
    (lambda: Scale(8), False), (lambda: NoisyNorm(8), False), (lambda: nn.Linear(8, 8), False),
    (lambda: PlainLinear(8, 8), False), (lambda: PlainEmbedding(10, 8), False), (lambda: nn.GELU(), False)])
def test_norms_are_found_by_what_they_compute(build, expected):
    module = build()
    assert normalises(module) is expected
    if expected and not isinstance(module, (nn.LayerNorm, nn.RMSNorm)):  # the probe left the module as it was
        assert all(p.device.type == "cpu" for p in module.parameters())


@pytest.mark.parametrize("build,expected", [
    (lambda: nn.LayerNorm(8), False), (lambda: nn.LayerNorm(8, elementwise_affine=False), False),
    (lambda: Standardise(8), True), (lambda: PlainLayerNorm(8), True),
    (_llama_rms_norm, True), (lambda: Root(8), True), (lambda: Scale(8), False), (lambda: nn.GELU(), False)])
def test_norms_written_out_are_found_to_keep_what_they_computed(build, expected):
    """A fused norm keeps its input and two numbers a row; one written in ops keeps a computed activation or more (x -
    mean, the normalised input): only those have their intermediates recomputed (see note: norms written out)."""
    assert keeps_intermediates(build()) is expected


class WrittenGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@pytest.mark.parametrize("build,expected", [
    (nn.GELU, True), (nn.SiLU, True), (nn.Mish, True), (GELUActivation, True), (WrittenGELU, True),
    (nn.ReLU, False), (nn.Tanh, False), (lambda: nn.Dropout(0.1), False), (nn.Identity, False),
    (lambda: nn.Softmax(-1), False), (lambda: nn.Linear(8, 8), False), (lambda: Root(8), False)])
def test_activation_functions_are_found_by_what_they_compute(build, expected):
    assert activates(build()) is expected


class FeedForward(nn.Module):
    """An MLP in the project's own Linear class, named nothing like ``*MLP``, with a GELU written out."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down, self.bend = PlainLinear(d, hidden), PlainLinear(hidden, d), WrittenGELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.bend(self.up(x)))


class LowRank(nn.Module):
    """Two linears with nothing between (a low-rank adapter): not an MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 2, bias=False), nn.Linear(2, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class Residual(nn.Module):
    """A block holding a written MLP and an adapter: the MLP is found inside it, the block is not an MLP (a norm)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.ff, self.adapter = PlainLayerNorm(d), FeedForward(d, 4 * d), LowRank(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x)) + self.adapter(x)


def _models() -> dict[str, nn.Module]:
    from tests import hf_models
    torch.manual_seed(0)
    return {"gpt": GPT(gpt_config("tiny")), "moe": GPT(gpt_config("tiny", moe_experts=4)),
            "llama-style": LlamaStyleNet(), "plain": PlainGPT(), "residual": nn.Sequential(Residual(16)),
            "llama": hf_models.build("llama"), "mixtral": hf_models.build("mixtral")}


def test_position_wise_mlps_are_found_by_what_they_compute():
    models = _models()
    found = {name: position_wise_mlps(model) for name, model in models.items()}
    assert found == {"gpt": ["blocks.0.mlp", "blocks.1.mlp"], "moe": [],
                     "llama-style": ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"], "plain": [],
                     "residual": ["0.ff"], "llama": ["model.layers.0.mlp", "model.layers.1.mlp"], "mixtral": []}
    assert all(p.device.type == "cpu" for model in models.values() for p in model.parameters())  # put back


def test_the_modules_that_attend_are_found_by_what_they_compute():
    found = {name: attention_modules(model) for name, model in _models().items() if name != "residual"}
    assert found == {"gpt": ["blocks.0.attn", "blocks.1.attn"], "moe": ["blocks.0.attn", "blocks.1.attn"],
                     "llama-style": ["layers.0.self_attn", "layers.1.self_attn", "layers.2.self_attn"],
                     "plain": ["blocks.0", "blocks.1"],  # attention written inline: the block that holds it
                     "llama": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
                     "mixtral": ["model.layers.0.self_attn", "model.layers.1.self_attn"]}


class PlainLM(PlainGPT):
    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(super().forward(ids).flatten(0, 1), targets.flatten())


def _train(root: str | None, tile: int | None, residual: bool) -> tuple[list[float], dict[str, torch.Tensor], list]:
    """Two ZeRO-3 steps of ``PlainLM`` with SGD (with ``residual``, one more block holding a written MLP): swapping
    attention to files under ``root``, tiling MLPs over ``tile`` tokens. SGD: a weight moves by its gradient (Adam
    would turn the rounding noise of a key bias's near-zero gradient into a full step)."""
    torch.manual_seed(0)
    model = PlainLM(vocab=64, d=32, layers=2, heads=4, seq=16)
    if residual:
        model.blocks.append(Residual(32))
    zp: dict = {"log_level": "warning", "memory_estimate": False}
    if root is not None:
        zp.update(swap_attention={"enabled": True, "min_bytes": 0}, activation_tier={"device": "file", "path": root})
    if tile is not None:
        zp.update(tiled={"mlp_tokens": tile})
    engine = zeroplus.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zeroplus": zp,
                                         "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    losses, saved = [], []
    for step in range(2):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = engine(x, x)
        saved.append(engine.ledger.saved_bytes("swap_attention", Category.ACTIVATION))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.consolidated_fp32_state(), saved


def test_swap_attention_and_tiling_take_a_model_whose_classes_say_nothing(tmp_path):
    """``PlainGPT`` writes attention inline in its blocks and has no class named ``*Attention`` or ``*MLP``: swap
    attention takes its blocks at ZeRO-3 (losses and weights bitwise those of the run without it, the swapped bytes
    on the ledger); tiling takes the written MLP of an added block (within the tiles' fp32 rounding)."""
    losses, weights, _ = _train(None, None, False)
    swapped, swapped_weights, saved = _train(str(tmp_path), None, False)
    assert all(b > 0 for b in saved) and swapped == losses
    assert all(torch.equal(weights[k], swapped_weights[k]) for k in weights)
    losses, weights, _ = _train(None, None, True)
    tiled, tiled_weights, _ = _train(None, 8, True)
    assert tiled == pytest.approx(losses, rel=1e-5)
    assert all(torch.allclose(weights[k], tiled_weights[k], rtol=1e-5, atol=1e-7) for k in weights)
