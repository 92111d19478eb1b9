"""Liger's Triton kernels for RMSNorm and SwiGLU (CUDA, where ``liger_kernel`` is installed): thin adapters.

``rms_norm_liger`` is ``LigerRMSNormFunction`` in its ``"llama"`` casting mode (Hugging Face's formula: the
input in fp32, normalised, rounded back to its dtype, times the weight), not in place (the incoming gradient
stays the caller's). It keeps ``x`` (input dtype) and one fp32 reciprocal root per row for backward: ``n d``
elements plus ``4 n`` bytes per norm, as ``kernels/rms_norm.py`` keeps ``x``. ``swiglu_liger`` is
``LigerSiLUMulFunction``: keeps ``gate`` and ``up`` (``2 n f`` elements), as ``kernels/swiglu.py``. Both
round as Liger's kernels do (fp32 inside, one rounding per output), within the dtype's rounding of eager,
not its bits.

Measured on one H100 (bf16, 16384 x 4096, forward plus backward, ``bench/bench_fused_ops.py --device cuda``):
RMSNorm 1.49-1.56 ms against eager's 3.55 and the replaying kernel's 4.62. Never run elsewhere: Triton
needs the GPU.

Reference twins: ``kernels.rms_norm.rms_norm_reference`` and ``kernels.swiglu.swiglu_reference``.
"""
from __future__ import annotations

import importlib.util

import torch

PACKAGE = "liger_kernel"


def available() -> bool:
    """Whether Liger is installed (its kernels run on CUDA only)."""
    return importlib.util.find_spec(PACKAGE) is not None


def rms_norm_liger(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # pragma: no cover (CUDA)
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, "llama", False)


def swiglu_liger(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # pragma: no cover (CUDA)
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    return LigerSiLUMulFunction.apply(gate, up)
