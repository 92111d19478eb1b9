"""``zeroplus.Init``: build a model at the memory of its shards (``gathered.py``: ``GatheredParameters``).

    with zeroplus.Init(config_dict_or_path="ds_config.json"):
        model = MyModel(...)                # each module partitioned as its __init__ finishes
    engine = zeroplus.initialize(model, "ds_config.json")

    with zeroplus.GatheredParameters(model.embed.weight, modifier_rank=0):
        model.embed.weight[pad] = 0         # whole while inside; rank 0's values kept on exit

While an ``Init`` is active, the ``__init__`` of every ``torch.nn.Module`` class is wrapped: when the
outermost ``__init__`` of a module returns, its own parameters (not its children's: they were
partitioned when theirs returned) are partitioned over the data-parallel group (``init_shards.py``:
rank r keeps chunk r of rank 0's values). Classes defined inside the context are wrapped as they
are defined. A parent that touches a child's partitioned parameter in its own ``__init__`` (weight
initialisation over the whole model, as GPT's ``apply(_init)`` and Hugging Face's ``post_init`` do)
gets it whole: a torch-function mode gathers any partitioned parameter an operation other than a
shape or dtype query touches, and keeps gathered the parameters of the operation at hand plus at most
``max_gathered_bytes`` (default 0) of others, re-partitioning the least recently touched from rank 0's
values (each rank ran the same code: rank 0's are the ones a
normal build on rank 0 makes). So a model built under ``Init`` equals, bit for bit, the same model
built normally on rank 0 and given to ``initialize``, while no more than one module's own parameters
and the gathered window are ever whole.

Memory per rank while building: the shards (1/N of every parameter), plus the module being
constructed, plus at most ``max_gathered_bytes`` of gathered parameters. ``initialize`` adopts the
shards: at ZeRO-3 each flat group's part is cut from every rank's chunks in one all-to-all
(``init_shards.redistribute``), at stages 0-2 the parameters are gathered one at a time into the flat
buffers every rank holds whole anyway.

The chunks keep the dtype the model was built in (fp32 for a model built in fp32), so the engine's
fp32 masters start from the same values as for a model built whole; ``dtype=`` casts them instead, as
DeepSpeed does with its config's precision.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from ..accelerator import get_accelerator
from ..comm import DataParallelGroup
from ..config import ConfigError, ZeroplusConfig, load_config
from . import init_shards
from .init_shards import shard_of

logger = logging.getLogger("zeroplus.zero")

# queries answered by the placeholder (right shape, dtype, device): no gather for them
_METADATA = {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "ndim", "layout", "names", "name",
             "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "__len__",
             "is_meta", "is_cuda", "is_sparse", "requires_grad_", "__hash__", "__eq__", "_version", "grad_fn"}


# in-place operations that write every element of their first argument without reading it (what weight
# initialisation runs: torch.nn.init's normal_, uniform_, zeros_, ones_, constant_, kaiming/xavier, ...)
_OVERWRITES = {"normal_", "uniform_", "zero_", "fill_", "random_", "exponential_", "geometric_", "cauchy_",
               "log_normal_", "copy_",  # Tensor methods; torch.nn.init's functions (seen first, with a mode on):
               "zeros_", "ones_", "constant_", "eye_", "dirac_", "kaiming_uniform_", "kaiming_normal_",
               "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_", "sparse_"}


def _overwrites(func: Any) -> bool:
    return getattr(func, "__name__", "") in _OVERWRITES


def _metadata_only(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA


class _GatherOnTouch(TorchFunctionMode):
    """Gathers a partitioned parameter when an operation touches it; keeps a bounded window gathered."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.window: collections.OrderedDict[int, torch.nn.Parameter] = collections.OrderedDict()
        self.pinned: set[int] = set()  # inside a GatheredParameters: never evicted

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not _metadata_only(func):
            touched = [t for value in (*args, *(kwargs or {}).values())
                       for t in (value if isinstance(value, (list, tuple)) else (value,))
                       if isinstance(t, torch.nn.Parameter) and shard_of(t) is not None]
            if touched:
                # (torch.nn.init's functions reach a mode with the tensor as a keyword)
                target = args[0] if args else (kwargs or {}).get("tensor")
                overwritten = target if _overwrites(func) else None
                self.touch(touched, overwritten)
        return func(*args, **(kwargs or {}))

    def touch(self, params: list[torch.nn.Parameter], overwritten: Any = None) -> None:
        """Gather ``params`` (one operation's; ``overwritten``, which the operation writes whole, only
        allocated), then return the least recently touched others to their shards until the window is
        within ``max_bytes`` (the operation's own stay, whatever their size)."""
        for param in params:
            init_shards.materialize(param, keep_values=param is not overwritten)
            self.window[id(param)] = param
            self.window.move_to_end(id(param))
        keep = {id(p) for p in params} | self.pinned
        for key in list(self.window):
            if sum(p.numel() * p.element_size() for p in self.window.values()) <= self.max_bytes:
                return
            if key not in keep:
                init_shards.repartition(self.window.pop(key), modifier_rank=0)

    def flush(self) -> None:
        for key in list(self.window):
            if key not in self.pinned:
                init_shards.repartition(self.window.pop(key), modifier_rank=0)


class Init:
    """DeepSpeed's ``zero.Init`` contract on zeroplus (see the module docstring)."""

    _active: Init | None = None  # the outermost active context (nested ones defer to it)

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: dict[str, Any] | str | os.PathLike | None = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 max_gathered_bytes: int = 0, **unsupported: Any) -> None:
        if unsupported:
            raise TypeError(f"zeroplus.Init: arguments {sorted(unsupported)} are not supported yet")
        source = config_dict_or_path if config_dict_or_path is not None else config
        self.config: ZeroplusConfig | None = load_config(source) if source is not None else None
        if self.config is not None:
            _check_supported(self.config)
        self.enabled = enabled
        self.dtype = dtype
        self.device = torch.device("cpu") if remote_device in ("cpu", "nvme") else get_accelerator().device()
        group = data_parallel_group if data_parallel_group is not None else (
            mpu.get_data_parallel_group() if mpu is not None else None)
        self.group = DataParallelGroup(group)
        self.mode = _GatherOnTouch(max_gathered_bytes)
        self._patched: list[tuple[type, Callable[..., None]]] = []
        self._outer = False
        if module is not None and enabled:
            self._partition_tree(module)

    # -- the context --------------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if Init._active is not None:  # nested: the outer context does the work
            return self
        Init._active, self._outer = self, True
        for cls in _module_classes():
            self._wrap(cls)
        self._original_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        context = self

        def init_subclass(cls: type, **kwargs: Any) -> None:  # (object's takes no keywords either)
            if kwargs:
                raise TypeError(f"{cls.__name__}.__init_subclass__() takes no keyword arguments {sorted(kwargs)}")
            context._wrap(cls)
        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._outer:
            return
        self.mode.__exit__(*exc)
        for cls, original in reversed(self._patched):
            cls.__init__ = original  # type: ignore[misc]
        self._patched.clear()
        if self._original_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._original_init_subclass  # type: ignore[assignment]
        Init._active, self._outer = None, False
        if exc[0] is None:
            self.mode.flush()

    # -- partitioning ---------------------------------------------------------------------------------
    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_zeroplus_wrapped", False):
            return
        context = self

        @functools.wraps(original)
        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            outermost = not module.__dict__.get("_zeroplus_constructing", False)
            if outermost:
                object.__setattr__(module, "_zeroplus_constructing", True)
            try:
                original(module, *args, **kwargs)
            finally:
                if outermost:
                    object.__delattr__(module, "_zeroplus_constructing")
            if outermost and Init._active is context:
                context._partition_own(module)
        wrapped._zeroplus_wrapped = True  # type: ignore[attr-defined]
        self._patched.append((cls, original))
        cls.__init__ = wrapped  # type: ignore[misc]

    def _partition_own(self, module: torch.nn.Module) -> None:
        for param in module.parameters(recurse=False):
            if shard_of(param) is None:
                init_shards.partition(param, self.group, self.device, self.dtype)

    def _partition_tree(self, module: torch.nn.Module) -> None:
        init_shards.partition_tree(module, self.group, self.device, self.dtype)


def _module_classes() -> list[type]:
    """Every subclass of ``torch.nn.Module`` defined so far (``Module`` itself has no parameters)."""
    seen: set[type] = set()
    stack = list(torch.nn.Module.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.add(cls)
            stack.extend(cls.__subclasses__())
    return list(seen)


def _check_supported(cfg: ZeroplusConfig) -> None:
    par = cfg.zeroplus.parallel
    sizes = {"tensor": par.tensor, "pipeline": par.pipeline, "expert": par.expert}
    split = {k: v for k, v in sizes.items() if v > 1}
    if split:
        raise ConfigError(f"zeroplus.Init with config key 'zeroplus.parallel' {split}: not supported yet "
                          f"(build the model normally, or on the meta device, for tensor, pipeline and expert "
                          f"parallelism)")
