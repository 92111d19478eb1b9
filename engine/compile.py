"""``engine.compile()``: each unit's compute compiled, the engine's mechanisms left eager.

What is compiled: the ``forward`` of every partition unit (the repeated blocks, ``zeroplus/zero/units.py``),
or of the whole model when it has no unit besides the root. The compiled ``forward`` replaces the module's
own as an instance attribute, so the module's ``__call__`` still runs the engine's hooks around it in
Python: stage 3's gather, prefetch and release, stages 1-2's wait for the post-step all-gather, the
routing of per-use gradients, swap attention and resize-based recompute (every such hook is marked
``zeroplus.eager.eager``; see note: compilation). Gradient reduction runs in autograd's hooks after each
parameter's gradient, outside any graph. So a unit's graph sees its parameters gathered and whole,
exactly as the eager forward does, and the graph has no collective and no storage change in it. Graph
breaks inside a unit are the model's own (zero for zeroplus's GPT blocks and Hugging Face Llama/Qwen2
decoder layers, ``tests/engine/test_compile.py``).

Not built (refused with an error): DeepSpeed's DeepCompile passes (``schedule``) and compiled
autograd (``compiled_autograd_enabled``): both would trace the engine's backward hooks.

Memory: the compiled graphs save what the compiler's partitioner chooses for backward, which may differ
from eager's saved activations (the budget's activation figures are eager-based); the engine's own
buffers are unchanged. Communication: unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """How the units are compiled: ``backend`` (a name torch.compile knows, or a callable) and the other
    ``torch.compile`` keyword arguments (``mode``, ``fullgraph``, ``dynamic``, ``options``)."""

    backend: str | Callable[..., Any] = "inductor"
    kwargs: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if "backend" in dict(self.kwargs):
            raise ValueError("compile(): give the backend as compile(backend=...), not inside compile_kwargs "
                             f"(compile_kwargs has backend={dict(self.kwargs)['backend']!r})")


class CompiledUnits:
    """The modules whose ``forward`` is compiled, and how; ``remove()`` puts the eager forwards back."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], settings: CompileSettings) -> None:
        self.settings = settings
        self.names = [name for name, _ in modules]
        self._modules = [module for _, module in modules]
        for module in self._modules:
            if "forward" in module.__dict__:
                raise ValueError(f"compile(): module {type(module).__name__} already has a forward of its own "
                                 f"(compiled or patched by other code); compile the engine before anything else "
                                 f"replaces it")
            module.forward = torch.compile(module.forward, backend=settings.backend,  # type: ignore[method-assign]
                                           **dict(settings.kwargs))

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop("forward", None)
        self._modules.clear()


def compile_settings(backend: Any, compile_kwargs: dict[str, Any] | None, schedule: Any = None,
                     compiled_autograd_enabled: bool = False) -> CompileSettings:
    """``engine.compile()``'s arguments checked (DeepSpeed's signature); errors for what is not built."""
    if schedule is not None:
        raise NotImplementedError(f"compile(schedule={schedule!r}): DeepSpeed's DeepCompile passes are not built; "
                                  f"call compile() without a schedule (each unit's compute is compiled, the "
                                  f"engine's gathers and reductions run eagerly around it)")
    if compiled_autograd_enabled:
        raise NotImplementedError("compile(compiled_autograd_enabled=True) is not built: compiled autograd would "
                                  "trace the engine's gradient hooks (reduction, release); call compile() without it")
    if not isinstance(compile_kwargs, (dict, type(None))):
        raise TypeError(f"compile(): compile_kwargs must be a dict of torch.compile arguments, got "
                        f"{type(compile_kwargs).__name__}")
    return CompileSettings(backend, tuple(sorted((compile_kwargs or {}).items())))
