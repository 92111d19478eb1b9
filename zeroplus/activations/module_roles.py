"""What a module does, found by running it on the meta device rather than read from its class name.

The techniques that act on one kind of module choose it here: resize recompute the norms and the activation
functions, tiling the position-wise MLPs, swap attention the modules that attend. A module's answer is found once,
before the partition releases any parameter (``remember``; a released stage-3 parameter's shape is ``(0,)``), and
kept.

One module alone (``normalises``, ``activates``, ``position_wise``): its forward runs once on an input of shape
``(2, 3, d)`` on the meta device, each parameter and buffer of the module swapped for a meta tensor of its shape for
that call (no values read, nothing allocated; put back after), under a dispatch mode that records the aten ops:

- a **norm**: torch's ``LayerNorm``, ``RMSNorm``, ``GroupNorm``; or a module whose own parameters are all
  one-dimensional of one size ``d`` (a scale, a shift; no child modules) and whose output has the input's shape
  after a reduction over the last dimension, with no matrix product, random draw, indexing or convolution
  (``x * rsqrt(x.pow(2).mean(-1) + eps) * w``, Hugging Face's ``LlamaRMSNorm``; not a scale alone, not a dropout);
  A norm **keeps intermediates** when, run with gradients, autograd keeps tensors it computed (not its input or
  parameters) worth at least its input: one written out in several ops, not a fused kernel;
- an **activation function** whose backward keeps its input: no parameters or children, the output of the input's
  shape, every op pointwise (torch's ``pointwise`` tag), one of them non-linear, and autograd saving the input itself
  (GELU, SiLU, a GELU written out with ``tanh``; not ReLU or Tanh, which save their output: dropping that output
  and keeping the input to recompute it would save nothing);
- a **position-wise MLP**: at least two matrix weights; for one of their sizes ``d``, the output of the input's
  shape after two or more matrix products with a non-linear pointwise op between, and nothing that mixes or routes
  tokens (no batched matrix product, reduction, softmax, top-k, sort, indexing, random draw or convolution). One
  held in a list or dict of modules (a mixture's experts, which get as many tokens as the router sends) and the
  model itself (its forward is the engine's) are not taken.

The whole model (``attention_modules``): its forward runs once on a meta copy on token ids of shape ``(1, 8)``; a
module **attends** if an attention kernel (``scaled_dot_product_*``, flash or memory-efficient attention) runs
inside it, or a softmax after a batched matrix product in the same module, and it is the innermost such module
holding parameters (the projections around the attention: Hugging Face's ``LlamaAttention``, a block that writes
attention out inline).
See note: modules by what they compute (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import _pop_mode, _push_mode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..meta_values import MetaValues, give_values

_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
# aten ops that draw, index, route or convolve (a part of the op's name: "native_dropout", "bernoulli_")
_DRAWS_OR_ROUTES = ("conv", "bernoulli", "rand", "dropout", "embedding", "index", "gather", "scatter", "topk", "sort",
                    "multinomial", "normal")
# aten ops a norm does not run: these and matrix products ("addmm")
_NOT_A_NORM = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear") + _DRAWS_OR_ROUTES
# reductions over given dimensions (their second argument)
_REDUCTIONS = ("mean", "sum", "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "amax", "amin",
               "logsumexp", "prod")
# fused norms with the normalised shape as their second argument
_FUSED_NORMS = ("native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm")
# pointwise ops that are not linear in their input
_NON_LINEAR = ("tanh", "erf", "erfc", "sigmoid", "exp", "expm1", "log", "log1p", "gelu", "silu", "mish", "relu",
               "elu", "celu", "selu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid", "softplus", "pow",
               "rsqrt", "sqrt", "sin", "cos", "atan", "clamp", "clamp_min", "clamp_max", "maximum", "minimum",
               "where", "abs", "sign", "logit")
# ops an MLP's matrix products dispatch to, and the ops that mix or route tokens
_MATMULS = ("mm", "addmm", "matmul", "linear")
_MIXES_TOKENS = ("bmm", "baddbmm", "softmax", "cumsum", "cumprod", "one_hot", "nonzero") + _DRAWS_OR_ROUTES
_SOFTMAX = ("_softmax", "softmax", "_safe_softmax")
# attention kernels (a part of the op's name)
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")

_ROLES: weakref.WeakKeyDictionary[nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()


class _Ops(TorchDispatchMode):
    """Records each aten op's name, arguments, overload and (with ``frames``) the innermost module running."""

    def __init__(self, frames: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, Any, nn.Module | None]] = []
        self.frames = frames
        self.run = MetaValues() if frames is not None else None  # a whole model: masks and routing read values

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = self.run(func, args, kwargs or {}) if self.run is not None else func(*args, **(kwargs or {}))
        frame = self.frames[-1] if self.frames else None
        self.calls.append((func.overloadpacket.__name__, args, func, frame))
        return out


def remember(model: nn.Module, mlps: bool = False) -> None:
    """Find the norms and activation functions of ``model`` (with ``mlps`` its position-wise MLPs too) now, while its
    parameters are whole, and keep the answers."""
    for module in model.modules():
        keeps_intermediates(module)
        activates(module)
    if mlps:
        position_wise_mlps(model)


def remember_attention(model: nn.Module) -> None:
    """Find the modules of ``model`` that attend (``attention_modules``) and keep the answer for each module. Raises
    what the model's forward on token ids raised."""
    chosen = set(attention_modules(model))
    for name, module in model.named_modules():
        _ROLES.setdefault(module, {})["attention"] = name in chosen


def _answer(module: nn.Module, role: str, find: Any) -> bool:
    known = _ROLES.setdefault(module, {})
    if role not in known:
        with _alone():
            known[role] = find(module)
    return known[role]


def normalises(module: nn.Module) -> bool:
    """Whether ``module`` is a norm over its input's last dimension (see the module's docstring)."""
    return _answer(module, "norm", lambda m: isinstance(m, _TORCH_NORMS) or _probe_norm(m))


def keeps_intermediates(module: nn.Module) -> bool:
    """Whether ``module``, a norm, has autograd keep tensors it computed (not its input or parameters) worth at least
    its input: a norm written out in several ops (``(x - m) / sqrt(v + eps) * w + b`` keeps ``x - m`` twice and the
    quotient; Hugging Face's ``LlamaRMSNorm`` the normalised input, and in bf16 an fp32 copy of it) rather than one
    fused kernel, which keeps its input and a mean and a scale per row."""
    return _answer(module, "intermediates", lambda m: normalises(m) and _probe_intermediates(m))


def activates(module: nn.Module) -> bool:
    """Whether ``module`` is a pointwise activation function whose backward keeps its input (the docstring)."""
    return _answer(module, "activation", _probe_activation)


def position_wise(module: nn.Module) -> bool:
    """Whether ``module``'s forward is a position-wise MLP (see the module's docstring)."""
    return _answer(module, "mlp", _probe_mlp)


def attends(module: nn.Module) -> bool:
    """Whether ``module`` was found to attend by ``remember_attention`` (else False)."""
    return _ROLES.get(module, {}).get("attention", False)


def position_wise_mlps(model: nn.Module) -> list[str]:
    """The qualified names of the outermost position-wise MLPs of ``model``, leaving out the model itself and
    modules held in a list or dict (a mixture's experts)."""
    held = {id(m) for c in model.modules() if isinstance(c, (nn.ModuleList, nn.ModuleDict)) for m in c.children()}
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or id(module) in held or any(name.startswith(f + ".") for f in found):
            continue
        if position_wise(module):
            found.append(name)
    return found


@contextlib.contextmanager
def _on_meta(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters and buffers (its children's too) swapped for meta tensors of their shapes; put back
    on exit."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    try:
        for m in module.modules():
            stores: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)
            for store in stores:
                for name, t in list(store.items()):
                    if t is None:
                        continue
                    saved.append((store, name, t))
                    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    store[name] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
        yield
    finally:
        for store, name, t in reversed(saved):
            store[name] = t


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """No function or dispatch mode of the caller's sees the probe (the budget's simulation builds its engine under
    its tracker: the probe's meta tensors are not the model's memory)."""
    functions = []
    while torch._C._len_torch_function_stack() > 0:
        functions.append(_pop_mode())
    try:
        with _disable_current_modes():
            yield
    finally:
        for mode in reversed(functions):
            _push_mode(mode)


def _run(module: nn.Module, x: torch.Tensor, grad: bool = False) -> tuple[Any, _Ops] | None:
    """``module``'s own forward on ``x`` on the meta device: its output and the ops it ran; None if it raised."""
    try:
        with _on_meta(module), torch.set_grad_enabled(grad), _Ops() as ops:
            return type(module).forward(module, x), ops
    except Exception:  # noqa: BLE001 - a module that does not take one tensor of this shape has no role here
        return None


def _probe_norm(module: nn.Module) -> bool:
    params = [p for p in module._parameters.values() if p is not None]
    if not params or any(True for _ in module.children()):
        return False
    if any(p.dim() != 1 for p in params) or len({p.shape[0] for p in params}) != 1:
        return False
    d = params[0].shape[0]
    if d < 2 or not params[0].is_floating_point():
        return False
    x = torch.empty(2, 3, d, dtype=params[0].dtype, device="meta")
    ran = _run(module, x)
    if ran is None or not isinstance(ran[0], torch.Tensor) or ran[0].shape != x.shape:
        return False
    reduced = False
    for name, args, _, _ in ran[1].calls:
        if any(bad in name for bad in _NOT_A_NORM):
            return False
        reduced |= name in _FUSED_NORMS or (name in _REDUCTIONS and len(args) > 1 and _last_dim(args[1], x.dim()))
    return reduced


def _probe_intermediates(module: nn.Module) -> bool:
    params = [p for p in module._parameters.values() if p is not None]
    if not params:  # (a norm without a scale or shift: torch's, whose one kernel keeps its input)
        return False
    x = torch.empty(2, 3, params[0].shape[0], dtype=params[0].dtype, device="meta", requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        own = [x] + [p for p in module._parameters.values() if p is not None]  # (the meta ones, while it runs)
        if not any(t is o or (t._base is not None and t._base is o) for o in own):
            kept[id(t)] = t.numel()
        return t.detach()  # (a saved output kept as itself would hold its own grad_fn: a cycle)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ran = _run(module, x, grad=True)
    return ran is not None and sum(kept.values()) >= x.numel()


def _last_dim(dims: Any, ndim: int) -> bool:
    dims = [dims] if isinstance(dims, int) else list(dims) if isinstance(dims, (list, tuple)) else []
    return any(isinstance(d, int) and d % ndim == ndim - 1 for d in dims)


def _probe_activation(module: nn.Module) -> bool:
    if any(True for _ in module.parameters()) or any(True for _ in module.children()):
        return False
    x = torch.empty(2, 3, 8, device="meta", requires_grad=True)
    kept: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t is x)
        return t.detach()  # (a saved output kept as itself would hold its own grad_fn: a cycle)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ran = _run(module, x, grad=True)
    if ran is None or not isinstance(ran[0], torch.Tensor) or ran[0].shape != x.shape or not any(kept):
        return False
    calls = ran[1].calls
    return bool(calls) and all(_pointwise(func) for _, _, func, _ in calls) and any(
        name in _NON_LINEAR for name, _, _, _ in calls)


def _pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in func.tags or func.overloadpacket.__name__ in ("_to_copy", "clone", "detach")


def _probe_mlp(module: nn.Module) -> bool:
    weights = [p for p in module.parameters() if p.dim() == 2 and p.is_floating_point()]
    if len(weights) < 2 or type(module).forward is nn.Module.forward:
        return False
    for d in sorted({s for w in weights for s in w.shape}):
        ran = _run(module, torch.empty(2, 3, d, dtype=weights[0].dtype, device="meta"))
        if ran is None or not isinstance(ran[0], torch.Tensor) or ran[0].shape != (2, 3, d):
            continue
        products, bent = 0, False  # products counted: the first, and each after a non-linear op
        for name, _, _, _ in ran[1].calls:
            if name in _REDUCTIONS or any(bad in name for bad in _MIXES_TOKENS):
                return False
            if name in _MATMULS:
                if products == 0 or bent:
                    products += 1
                bent = False
            elif name in _NON_LINEAR:
                bent = True
        return products >= 2
    return False


def attention_modules(model: nn.Module) -> list[str]:
    """The qualified names of the modules of ``model`` that attend (see the module's docstring), found by one
    forward of a meta copy on token ids. Raises what that forward raised (a model that does not take token ids)."""
    with _alone():
        return _attending(model)


def _attending(model: nn.Module) -> list[str]:
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    twin = copy.deepcopy(model, memo)
    names = {id(m): n for n, m in twin.named_modules()}
    frames: list[nn.Module] = []

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        frames.pop()

    for m in twin.modules():
        m.register_forward_pre_hook(lambda module, args: frames.append(module))
        m.register_forward_hook(leave)
    tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
    give_values(tokens, torch.zeros(1, 8, dtype=torch.long))
    with torch.no_grad(), _Ops(frames) as ops:
        twin(*token_inputs(twin, tokens))
    parents = {id(c): m for m in twin.modules() for c in m.children()}
    found: list[str] = []
    after_bmm: set[int] = set()  # modules that ran a batched matrix product (scores)
    for name, _, _, frame in ops.calls:
        if frame is None:
            continue
        if name in ("bmm", "baddbmm"):
            after_bmm.add(id(frame))
        elif any(a in name for a in _ATTENTION) or (name in _SOFTMAX and id(frame) in after_bmm):
            owner = _holder(frame, parents)
            if owner is not None and names[id(owner)] not in found:
                found.append(names[id(owner)])
    return [n for n in found if n]


def _holder(frame: nn.Module, parents: dict[int, nn.Module]) -> nn.Module | None:
    """The innermost module holding parameters among ``frame`` and its ancestors (``parents``: child id -> parent)."""
    module: nn.Module | None = frame
    while module is not None and not any(True for _ in module.parameters()):
        module = parents.get(id(module))
    return module


def token_inputs(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inputs for a language model: ``tokens`` as its token ids, and as its targets too when its forward takes them
    (the built-in GPT returns its loss then)."""
    params = list(inspect.signature(model.forward).parameters)
    return (tokens, tokens) if len(params) >= 2 and params[1] in ("targets", "labels") else (tokens,)
