"""Resize recompute finds normalisation layers by what they compute, whatever their class is called
(``zeroplus/activations/norm_probe.py``): torch's norms, Hugging Face's ``LlamaRMSNorm``, a LayerNorm or an RMSNorm
written out under any name; not a scale alone (no reduction), a dropout after a norm (a random draw), a linear
layer or an embedding. The answer is kept from before the partition releases the parameters."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.memory.test_resize_recompute import Standardise
from tests.models import PlainEmbedding, PlainLayerNorm, PlainLinear
from zeroplus.activations.norm_probe import normalises


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
