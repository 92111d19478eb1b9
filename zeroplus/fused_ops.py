"""Fused operators for the model families: which kernel each device runs, and their installation in a model.

``zeroplus.fused_ops: true`` replaces, in the model given to ``initialize``, the forward of

- every RMSNorm of the Llama family (a class named ``*RMSNorm`` with ``weight`` and ``variance_epsilon`` or
  ``eps``, Hugging Face's formula: ``kernels/rms_norm.py``) and
- every gated MLP (``gate_proj``, ``up_proj``, ``down_proj`` and a SiLU ``act_fn``, torch's or Hugging Face's:
  ``kernels/swiglu.py``)

with the device's kernel from ``KERNELS``: on the CPU (and CUDA, where no fused library is installed) the
lean kernels, which keep fewer tensors for backward and equal eager autograd bit for bit; on an
Ascend NPU ``torch_npu``'s fused operators (never run here). Rotary embedding and grouped expert products
stay as the model writes them on the CPU and CUDA (their kernels, ``kernels/rotary.py`` and
``kernels/grouped_gemm.py``, are measured in ``bench/bench_fused_ops.py``). A config asking for fused
operators in a model with none of these modules is refused (nothing would change).

``zeroplus.fused_ops: "compiled"`` (CPU and CUDA) installs instead the reference twins compiled by
``torch.compile`` (inductor; ``compiled_kernels``): on this CPU the fastest of all (RMSNorm 5.5x eager, SwiGLU
2.2x, ``bench/bench_fused_ops.py``), each a few fused loops whose backward the partitioner recomputes rather
than keeps; the values round as inductor's kernels do (within fp32 rounding of eager, not its bits), and each
process pays a compile per shape (seconds, the first steps). ``"liger"`` (CUDA, ``liger_kernel`` installed):
Liger's Triton kernels (``kernels/liger.py``), rounding as they do. ``"fastest"``: the fastest measured on
the device (``FASTEST``): Liger on CUDA where it is installed, else the compiled references (on one H100,
bf16 16384 x 4096: RMSNorm eager 3.55 ms, replaying kernel 4.62, compiled 1.59, Liger 1.49); the compiled
references on the CPU; the NPU's fused operators. A choice the rank's device cannot run is refused naming
the key, the device and what is missing, on every rank, before the model is touched.

Memory: per RMSNorm, ``n d`` elements of the input's dtype held for backward instead of eager's fp32 copy and
normalised values (8 bytes per element in fp32, 6 in bf16); per gated MLP, one ``n f`` intermediate fewer
(``silu(gate)``). See the kernels' docstrings. Installed once per model; ``destroy()`` leaves it installed.
See note: fused operators (docs/design-notes.md).
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn

from .config import ConfigError
from .kernels import liger
from .kernels.rms_norm import rms_norm, rms_norm_npu, rms_norm_reference
from .kernels.swiglu import swiglu, swiglu_npu, swiglu_reference

# accelerator name -> operator -> kernel (see the module docstring for why each)
KERNELS: dict[str, dict[str, Callable[..., Any]]] = {
    "cpu": {"rms_norm": rms_norm, "swiglu": swiglu},
    "cuda": {"rms_norm": rms_norm, "swiglu": swiglu},
    "npu": {"rms_norm": rms_norm_npu, "swiglu": swiglu_npu},
}


COMPILED_DEVICES = ("cpu", "cuda")  # where inductor compiles (the NPU's compiler is another package)
_compiled: dict[str, Callable[..., Any]] = {}


def compiled_kernels() -> dict[str, Callable[..., Any]]:
    """The reference twins compiled by ``torch.compile`` (inductor), made once per process."""
    if not _compiled:
        _compiled.update(rms_norm=torch.compile(rms_norm_reference), swiglu=torch.compile(swiglu_reference))
    return _compiled


LIGER: dict[str, Callable[..., Any]] = {"rms_norm": liger.rms_norm_liger, "swiglu": liger.swiglu_liger}


def _fastest(device: str) -> str | bool:
    """``"fastest"`` on ``device``: what bench/bench_fused_ops.py measured fastest there."""
    if device == "cuda":
        return "liger" if liger.available() else "compiled"
    return "compiled" if device in COMPILED_DEVICES else True


def kernels_for(device: str, choice: bool | str) -> tuple[dict[str, Callable[..., Any]], str]:
    """(operator -> kernel, what it is) for ``zeroplus.fused_ops`` = ``choice`` on ``device``; a choice the
    device cannot run is a ConfigError naming the key, the device and what is missing."""
    if device == "meta":  # the memory estimate's model: the lean kernels keep what the others keep
        return KERNELS["cpu"], "kernels"
    if choice == "fastest":
        choice = _fastest(device)
    if choice == "compiled":
        if device not in COMPILED_DEVICES:
            raise ConfigError(f"config key 'zeroplus.fused_ops' is 'compiled', which compiles with inductor on "
                              f"{' and '.join(COMPILED_DEVICES)}, not on this rank's {device}: use true for its "
                              f"fused operators")
        return compiled_kernels(), "compiled references"
    if choice == "liger":
        if device != "cuda":
            raise ConfigError(f"config key 'zeroplus.fused_ops' is 'liger', whose Triton kernels run on CUDA, not "
                              f"on this rank's {device}: use true or 'fastest'")
        if not liger.available():
            raise ConfigError("config key 'zeroplus.fused_ops' is 'liger' but the package 'liger_kernel' is not "
                              "installed on this rank (pip install liger-kernel), or use 'fastest'")
        return LIGER, "Liger kernels"
    return KERNELS[device], "kernels"


_SILU = ("SiLU", "SiLUActivation")  # torch's, and Hugging Face's (``F.silu`` of its input)


def _norm_eps(module: nn.Module) -> float | None:
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(getattr(module, "weight", None), nn.Parameter):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _is_gated_mlp(module: nn.Module) -> bool:
    return (all(isinstance(getattr(module, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(module, "act_fn", None)).__name__ in _SILU)


def install(model: nn.Module, device: str, choice: bool | str = True) -> tuple[list[str], str]:
    """Replace the forward of ``model``'s RMSNorms and gated MLPs with the kernels ``kernels_for(device,
    choice)`` names; (the names replaced, what runs). ``Engine.destroy`` gives the forwards back
    (``engine/model_patches.py``)."""
    table, what = kernels_for(device, choice)
    done = []
    for name, module in model.named_modules():
        eps = _norm_eps(module)
        if eps is not None:
            norm = table["rms_norm"]

            def norm_forward(self: nn.Module, x: torch.Tensor, eps: float = eps, norm: Any = norm) -> torch.Tensor:
                return norm(x, self.weight, eps)
            module.forward = types.MethodType(norm_forward, module)  # type: ignore[method-assign]
            done.append(name)
        elif _is_gated_mlp(module):
            act = table["swiglu"]

            def mlp_forward(self: Any, x: torch.Tensor, act: Any = act) -> torch.Tensor:
                return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))
            module.forward = types.MethodType(mlp_forward, module)  # type: ignore[method-assign]
            done.append(name)
    return done, what
