"""The engine's hooks run eagerly, never inside a compiled graph (see note: compilation).

A forward hook the engine puts on a module (stage 3's gather and release, stages 1-2's wait for the
post-step all-gather, per-use gradient routing, swap attention, resize-based recompute) waits on
collectives, resizes storages and swaps parameters: state that changes from call to call and that a
traced graph would freeze at its first value. ``eager(hook)`` marks the hook so that TorchDynamo
never traces it: a module compiled with ``torch.compile`` or ``module.compile()`` runs the hook as
Python between its graphs (the compiled code calls out to it), and the graphs read the parameters the
hook has just gathered. Memory and communication: none of its own.

``in_backward()`` answers a hook's "is autograd running a backward?" (a forward run inside backward is
an activation-checkpoint replay). Torch has no public call for it; this is the one place zeroplus makes
the private one, and ``tests/zero/test_in_backward.py`` fails if a torch release changes its answer.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(hook: F) -> F:
    """``hook``, never traced by TorchDynamo (it and everything it calls run as Python)."""
    return torch.compiler.disable(hook, recursive=True)  # type: ignore[return-value]


class EagerWhileActive:
    """Mixed into a mode the engine enters around real work (a ``TorchDispatchMode``: the estimator's tracker, the
    activation census, the FLOPs counter): while it is active, compiled code runs eagerly
    (``torch.compiler.set_stance("force_eager")``). Under a dispatch mode TorchDynamo refuses a frame and remembers
    the refusal for the code object, which left a compiled function inside the model uncompiled for the whole run
    (see note: dispatch modes and compiled functions). List it before the mode's class."""

    def __enter__(self) -> Any:
        self._eager = torch.compiler.set_stance("force_eager")
        self._eager.__enter__()
        return super().__enter__()  # type: ignore[misc]

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)  # type: ignore[misc]
        finally:
            self._eager.__exit__(*exc)


def in_backward() -> bool:
    """Whether this thread is running autograd's backward (a hook called from inside it: a checkpoint replay)."""
    return torch._C._current_graph_task_id() != -1


def compiled_wrapper(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(inner)``'s wrapper (asked by name, which needs no import of
    TorchDynamo's classes)."""
    return type(module).__name__ == "OptimizedModule" and isinstance(getattr(module, "_orig_mod", None),
                                                                    torch.nn.Module)


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """Qualified names of ``model``'s modules that run compiled: wrapped by ``torch.compile(module)``,
    compiled in place by ``module.compile()``, or given a compiled ``forward`` (``engine.compile()``)."""
    found = []
    for name, module in model.named_modules():
        compiled_forward = hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")
        if compiled_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None or compiled_forward:
            found.append(name or "<model>")
    return found
