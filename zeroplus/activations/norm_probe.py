"""Which modules are normalisation layers, by what they compute rather than their class.

Resize recompute drops a norm's output after forward and runs the module again in backward (see note: recompute by
default). A module counts as a norm if it is torch's ``LayerNorm``, ``RMSNorm`` or ``GroupNorm`` (or a subclass),
or if, whatever its class is called, its forward normalises over the last dimension: its own parameters are all
one-dimensional of one size ``d`` (a scale, a shift; no child modules), and its forward, run once on the meta device
on an input of shape ``(2, 3, d)`` (no hooks, no values read, nothing allocated), returns a tensor of that shape
after at least one reduction over the last dimension, with no matrix product, random draw, indexing or convolution
on the way. That takes the norms a codebase writes out (``x * rsqrt(x.pow(2).mean(-1) + eps) * w``, Hugging
Face's ``LlamaRMSNorm``, a user's ``LN``), and leaves a scale-only module (no reduction), a linear layer and a
dropout out. The answer is found once per module, before the partition releases any parameter, and kept
(``remember_norms``): a released stage-3 parameter's shape is ``(0,)``.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_NORMS = (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm)
# aten ops a normalisation does not run (a part of the op's name: "addmm", "native_dropout", "bernoulli_")
_NOT_A_NORM = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "conv", "bernoulli", "rand", "dropout",
               "embedding", "index", "gather", "scatter", "topk", "sort", "multinomial", "normal")
# reductions over given dimensions (their second argument)
_REDUCTIONS = ("mean", "sum", "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "amax", "amin",
               "logsumexp", "prod")
# fused norms with the normalised shape as their second argument
_FUSED_NORMS = ("native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm")

_FOUND: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls.append((func.overloadpacket.__name__, args))
        return func(*args, **(kwargs or {}))


def remember_norms(model: torch.nn.Module) -> None:
    """Find the answer for every module of ``model`` now (its parameters still whole) and keep it."""
    for module in model.modules():
        normalises(module)


def normalises(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer over its input's last dimension (see the module's docstring)."""
    if module not in _FOUND:
        _FOUND[module] = isinstance(module, _TORCH_NORMS) or _probe(module)
    return _FOUND[module]


def _probe(module: torch.nn.Module) -> bool:
    params = [(n, p) for n, p in module._parameters.items() if p is not None]
    if not params or any(True for _ in module.children()):
        return False
    if any(p.dim() != 1 for _, p in params) or len({p.shape[0] for _, p in params}) != 1:
        return False
    d = params[0][1].shape[0]
    if d < 2 or not params[0][1].is_floating_point():
        return False
    dtype = params[0][1].dtype
    saved = dict(params)
    x = torch.empty(2, 3, d, dtype=dtype, device="meta")
    try:
        for name, p in params:
            module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                          requires_grad=p.requires_grad)
        with torch.no_grad(), _Ops() as ops:
            out = type(module).forward(module, x)
    except Exception:  # noqa: BLE001 - a module that does not take one tensor is not a norm here
        return False
    finally:
        for name, p in saved.items():
            module._parameters[name] = p
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return False
    reduced = False
    for name, args in ops.calls:
        if any(bad in name for bad in _NOT_A_NORM):
            return False
        if name in _FUSED_NORMS:
            reduced = True
        elif name in _REDUCTIONS and len(args) > 1 and _last_dim(args[1], x.dim()):
            reduced = True
    return reduced


def _last_dim(dims: Any, ndim: int) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else []
    return any(isinstance(d, int) and d % ndim == ndim - 1 for d in dims)
