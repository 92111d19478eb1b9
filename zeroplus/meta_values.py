"""Values the meta device does not have: small known tensors shadowed on the CPU, and stand-ins.

The simulation runs the model on meta tensors, which have shapes and no values. Most of a forward
never looks at values, but models do in a few places: Hugging Face builds its attention masks
from position ids and the attention mask (``(mask == 0).all()`` decides whether a mask is needed,
``diff(position_ids)`` finds packed sequences), and a mixture of experts sends each expert the
tokens the router chose (``nonzero``, ``histc`` of the top-k indices). ``MetaValues`` answers them
exactly where the answer is known, and names the operation where it is not:

- **Shadows.** A meta tensor whose values are known carries them as a CPU tensor (``SHADOW``):
  the example inputs (token ids, attention masks, positions), tensors made by factories
  (``arange``, ``zeros``, ``full``, and ``*_like`` ones whose values do not depend on the input),
  and every result of an operation all of whose tensor inputs have shadows. Each operation runs on
  meta as before (so views stay views and the tracker sees the same storages) and, when its inputs
  are known and its result has at most ``LIMIT`` elements, once more on the shadows; an in-place
  write from unknown values drops the target's shadow. Scalars (``item()``, ``bool()``) and
  results whose shape depends on values (``nonzero``, ``masked_select``, ``unique``) come from the
  shadows: the meta result is an empty meta tensor of the shadow's shape.
- **Routing.** A ``topk`` over values the simulation does not have (a router's logits) returns
  indices that route round-robin: row ``n`` picks ``(n*k + j) mod E``, so every token goes to ``k``
  distinct experts and each expert gets ``k/E`` of the tokens. What the experts save for backward
  is then what any routing saves (every token's ``k`` expert outputs); one expert's transient batch
  is the balanced one (a skewed routing can give one expert up to all tokens).
- **Meta kernels narrower than CPU's.** ``_grouped_mm`` (Hugging Face's MoE experts) has a meta
  kernel that accepts only bf16 while the CPU kernel takes fp32 too: its shape is asked of the
  meta kernel in bf16 and the result made in the input's dtype.

Anything else that needs values it does not have raises ``SimulationError`` naming the operation.

Memory: the shadows are CPU tensors of at most ``LIMIT`` elements each, held as long as their meta
tensors; they are outside the tracker (which counts the simulated rank, not this process).
See note: meta values (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

SHADOW = "_zeroplus_values"
LIMIT = 1 << 16  # elements: ids, masks, positions and routing indices, never activations or gradients

aten = torch.ops.aten

# Results whose values do not depend on their tensor input's values (only on its shape and dtype).
_VALUE_FREE = {aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.new_ones.default,
               aten.new_zeros.default, aten.new_full.default, aten.scalar_tensor.default}
# CPU kernels that take only floating inputs where the model (seeing a non-CPU device) passes integers.
_CPU_FLOAT_ONLY = {aten.histc.default}
# Meta kernels that refuse dtypes the CPU kernel takes: their shapes are asked in bf16.
_BF16_META = {getattr(aten, "_grouped_mm").default} if hasattr(aten, "_grouped_mm") else set()
_SPECIAL = _VALUE_FREE | _BF16_META | {aten.topk.default}  # handled even when no input has values
# Results whose values are undefined (allocations): they carry none, so what is computed from them (a flat buffer's
# views, copies and updates) runs on the meta device only, not again on CPU shadows.
_UNDEFINED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
              aten.new_empty.default, aten.new_empty_strided.default, aten.empty_permuted.default}


class SimulationError(RuntimeError):
    """The model needs values the meta-device simulation does not have."""


def shadow_of(t: Any) -> torch.Tensor | None:
    """The known values of meta tensor ``t`` (a CPU tensor), or None."""
    return getattr(t, SHADOW, None) if isinstance(t, torch.Tensor) else None


def give_values(meta: torch.Tensor, values: torch.Tensor) -> None:
    """Let ``meta`` carry ``values`` (a real tensor of its shape) if it is small enough."""
    if values.numel() <= LIMIT and values.device.type != "meta":
        setattr(meta, SHADOW, values.detach().to("cpu"))


def _known(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.device.type != "meta" or shadow_of(t) is not None


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return shadow_of(value)
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    return value


def _shadow_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tree_map(_on_cpu, args), tree_map(_on_cpu, kwargs)


_WRITES: dict[Any, list[tuple[int, str]]] = {}  # func -> (position, name) of the arguments it writes


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes into (in-place and ``out=`` operations)."""
    if func not in _WRITES:
        schema = getattr(func, "_schema", None)
        _WRITES[func] = [(i, arg.name) for i, arg in enumerate(schema.arguments if schema is not None else ())
                         if arg.alias_info is not None and arg.alias_info.is_write]
    out: list[torch.Tensor] = []
    for i, name in _WRITES[func]:
        value = args[i] if i < len(args) else kwargs.get(name)
        out.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return out


def _meta_like(value: Any) -> Any:
    """A meta tensor of a CPU result's shape and dtype, carrying it as its values."""
    if not isinstance(value, torch.Tensor):
        return value
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    give_values(meta, value)
    return meta


def _round_robin(values: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    """Top-k indices that send row ``n`` to ``(n*k + j) mod E`` (``E``: the size of ``dim``)."""
    experts = values.shape[dim] if values.dim() else 1
    moved = list(values.shape)
    moved.pop(dim % max(values.dim(), 1))
    rows = 1
    for n in moved:
        rows *= n
    idx = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % experts
    return idx.reshape(*moved, k).movedim(-1, dim)


def _topk_stand_in(args: tuple, kwargs: dict, out: Any) -> None:
    values = args[0]
    k = args[1] if len(args) > 1 else kwargs["k"]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    indices = out[1]
    if indices.numel() <= LIMIT:
        give_values(indices, _round_robin(values, int(k), int(dim)))


_FRESH: dict[Any, bool] = {}  # func -> whether it returns only new tensors and writes nothing (no alias in its schema)


def _fresh(func: Any) -> bool:
    if func not in _FRESH:
        schema = getattr(func, "_schema", None)
        _FRESH[func] = schema is not None and not schema.is_mutable and bool(schema.returns) and all(
            r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns) and not any(
            a.alias_info is not None for a in schema.arguments)
    return _FRESH[func]


_POINTWISE_INPLACE: dict[Any, bool] = {}  # func -> whether it is a pointwise op writing its first argument only


def _pointwise_inplace(func: Any) -> bool:
    """``add_``, ``mul_``, ``lerp_``: returns its first argument, whose shape it does not change (pointwise)."""
    if func not in _POINTWISE_INPLACE:
        schema = getattr(func, "_schema", None)
        writes = [a for a in (schema.arguments if schema is not None else ()) if a.alias_info is not None]
        _POINTWISE_INPLACE[func] = (
            schema is not None and torch.Tag.pointwise in func.tags and len(schema.returns) == 1
            and len(writes) == 1 and writes[0] is schema.arguments[0] and writes[0].alias_info.is_write
            and schema.returns[0].alias_info is not None
            and set(schema.returns[0].alias_info.before_set) == set(writes[0].alias_info.before_set))
    return _POINTWISE_INPLACE[func]


def _key(value: Any) -> Any:
    """What a meta kernel's result depends on, hashable: a tensor's shape, strides, dtype and offset; plain values
    as they are (None where the value is not plain: such calls are not remembered)."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.stride(), value.dtype, value.storage_offset(), value.device.type)
    if isinstance(value, dict):
        return _key(tuple(sorted(value.items())))
    if isinstance(value, (list, tuple)):
        parts = tuple(_key(v) for v in value)
        return None if any(p is None for p in parts) else (type(value).__name__, parts)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return (type(value).__name__, value)
    return None


def _plain(results: tuple, inputs: list[torch.Tensor]) -> bool:
    """Whether each result has a storage of its own that ``empty_strided`` of its shape would make (the tracker
    counts storages): none shared, none an input's (``_unsafe_view``'s schema promises a new tensor and returns its
    input's storage: a remembered one made a new storage, a logits-sized 125 MiB counted twice in a Llama's forward),
    none larger, none offset."""
    storages = {t.untyped_storage()._cdata for t in results}
    given = {t.untyped_storage()._cdata for t in inputs}
    return len(storages) == len(results) and not storages & given and all(
        t.storage_offset() == 0 and t.untyped_storage().nbytes()
        == torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes()
        for t in results)


# the shapes remembered, for the whole process: a result's shapes depend on its key only, so every simulation (the
# estimate's runs with and without a technique, the planner's, a later engine's) reads what an earlier one ran; cleared
# when it holds SHAPES_KEPT keys (a key is some hundred bytes)
_SHAPES: dict[Any, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]] = {}
SHAPES_KEPT = 100_000


class MetaValues:
    """Runs one aten operation for the tracker on meta tensors, keeping and using known values. ``routed``:
    how many ``topk`` results it made up (a router's choice, routed round-robin).

    A meta kernel's result depends only on its arguments' shapes, strides, dtypes and plain values, and most run
    as Python (torch's reference implementations): the shapes of an operation that returns only new tensors and
    writes none (no alias in its schema) are remembered by those, and a later call with the same gets new empty
    meta tensors of them without running the kernel (the simulation's steps and a model's layers repeat the same
    calls; half the simulation's time was those kernels). What is remembered is kept for the process (``_SHAPES``):
    a second simulation of the same model, as the estimate's run without a technique or a second engine's, runs
    no kernel it ran before (a tiny GPT's first-forward prediction 0.84 -> 0.48 s in a process's second engine).
    """

    def __init__(self) -> None:
        self.routed = 0
        self.ran = 0  # kernels run for a key not remembered yet (what the process-wide memory spares)

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensors = _tensor_args(args, kwargs)
        metas = [t for t in tensors if t.device.type == "meta"]
        if not metas and not _makes_meta(kwargs):
            return func(*args, **kwargs)  # nothing simulated (a real CPU tensor, e.g. the estimate's own)
        if metas and func not in _SPECIAL and not any(hasattr(t, SHADOW) for t in metas):
            inplace = _pointwise_inplace(func)
            key = (func, _key(args), _key(kwargs)) if inplace or _fresh(func) else None
            key = None if key is not None and None in key else key  # (an argument not plain: not kept)
            shapes = _SHAPES.get(key) if key is not None else None
            if shapes is not None and inplace:  # (checked once for these shapes: the write is its own result)
                return args[0]
            if shapes is not None:
                made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                        for shape, stride, dtype in shapes]
                return made[0] if len(made) == 1 else tuple(made)
            try:  # the common case: values unknown, and none to keep or drop
                out = func(*args, **kwargs)
            except (NotImplementedError, RuntimeError) as err:
                raise _cannot_run(func, err) from None
            if key is not None:
                self.ran += 1
                if len(_SHAPES) >= SHAPES_KEPT:
                    _SHAPES.clear()
                results = out if isinstance(out, tuple) else (out,)
                metas_only = all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in results)
                if inplace:
                    _SHAPES[key] = []
                elif metas_only and _plain(results, metas):
                    _SHAPES[key] = [(tuple(t.shape), t.stride(), t.dtype) for t in results]
            return out
        if func in _UNDEFINED:
            return func(*args, **kwargs)
        known = (all(_known(t) for t in tensors) or func in _VALUE_FREE) and _deterministic(func)
        try:
            out = self._run_meta(func, args, kwargs)
        except (NotImplementedError, RuntimeError) as err:  # needs values: a scalar or a value-shaped result
            if not known:
                raise _cannot_run(func, err) from None
            return tree_map(_meta_like, self._run_on_shadows(func, args, kwargs, tensors))
        if func is aten.topk.default and not known:
            self.routed += 1
            _topk_stand_in(args, kwargs, out)
            return out
        if known and all(t.numel() <= LIMIT for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)):
            self._attach(func, args, kwargs, tensors, out)
        else:
            _forget(_written(func, args, kwargs))  # written from values we do not have
        return out

    @staticmethod
    def _run_meta(func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _BF16_META:
            def cast(t: Any) -> Any:
                is_float = isinstance(t, torch.Tensor) and t.is_floating_point()
                return t.to(torch.bfloat16) if is_float else t
            shaped = func(*tree_map(cast, args), **tree_map(cast, kwargs))
            dtype = args[0].dtype
            return tree_map(lambda t: torch.empty_like(t, dtype=dtype) if isinstance(t, torch.Tensor) else t, shaped)
        return func(*args, **kwargs)

    @staticmethod
    def _run_on_shadows(func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if func in _VALUE_FREE:  # only the input's shape matters: a CPU tensor of it stands in
            sub: dict[int, torch.Tensor] = {id(t): torch.zeros(t.shape, dtype=t.dtype) for t in tensors
                                           if t.device.type == "meta" and shadow_of(t) is None}
            args, kwargs = tree_map(lambda v: sub.get(id(v), v), (args, kwargs))
        cpu_args, cpu_kwargs = _shadow_args(args, kwargs)
        if func in _CPU_FLOAT_ONLY and not cpu_args[0].is_floating_point():
            dtype = cpu_args[0].dtype
            return func(cpu_args[0].double(), *cpu_args[1:], **cpu_kwargs).to(dtype)
        return func(*cpu_args, **cpu_kwargs)

    def _attach(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor], out: Any) -> None:
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if not results:
            return
        try:
            cpu_out = self._run_on_shadows(func, args, kwargs, tensors)
        except (NotImplementedError, RuntimeError):  # no CPU kernel for it: its results have no values
            _forget(results + _written(func, args, kwargs))
            return
        for meta, value in zip(results, [t for t in tree_flatten(cpu_out)[0] if isinstance(t, torch.Tensor)]):
            if meta.shape == value.shape:
                give_values(meta, value)


def _cannot_run(func: Any, err: Exception) -> SimulationError:
    return SimulationError(f"the memory simulation cannot run {func} on the meta device: it needs values "
                           f"computed from the model's parameters ({err})")


def _forget(tensors: list[torch.Tensor]) -> None:
    """Drop the known values of ``tensors`` (they were written from values the simulation lacks)."""
    for t in tensors:
        if hasattr(t, SHADOW):
            delattr(t, SHADOW)


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an aten operation's arguments (which nest at most one list deep)."""
    out: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(t for t in value if isinstance(t, torch.Tensor))
    return out


def _deterministic(func: Any) -> bool:
    """Random operations are never replayed on the CPU: they would move the process's generator."""
    return torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ())


def _makes_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"

