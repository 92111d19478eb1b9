"""Bytes of every tensor storage alive, after every operation, on any device (the meta device too).

A ``TorchDispatchMode`` sees every operation's outputs, factories included; each new storage is
remembered through a weak reference whose callback subtracts its bytes when it dies, and
``UntypedStorage.resize_`` is watched while the tracker is active (stage-3 gather and release,
resize recompute), so the bytes alive are known after every operation without a scan. That sum,
the peak of it per phase, and at each phase's peak the split by owner are what the estimator
reports:

- the engine's own buffers, per ledger category (the ledger says which storages it holds);
- ``activation``: the ledger's own (activations the engine manages) plus the storages alive at
  the end of a forward that the ledger does not hold, i.e. what autograd saved for backward
  after the recompute, swap and checkpointing choices (plus the forward's output, a few bytes
  for a loss);
- ``temporaries``: everything else the ledger does not hold (gradients autograd is passing
  between operations, parameter gradients before the engine flattens them, kernel outputs).

At the forward's peak the split between activations and temporaries is known only at the end of
the forward: the activations are taken as what the forward leaves for backward (at most the
bytes outside the ledger at the peak), the rest as temporaries.

Memory: one weak reference and two dict entries per live storage. Cost: O(outputs) per
operation and O(live storages) once per forward.
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..cpu_precision import native_bf16
from ..eager import EagerWhileActive
from ..host_gemm_pool import POOLED, signature
from ..ledger import Category, Ledger
from ..meta_values import MetaValues

aten = torch.ops.aten

# Backward formulas that build a gradient as zeros with values put in (a lookup's by index, index_select or gather)
# do it in place, except where a tensor is "subclass-like": a meta tensor, or any tensor while a dispatch
# mode is on (ATen's ``isTensorSubclassLike``), which is how the estimator sees them. There they put the values into a
# copy of the zeros, two tensors of the weight's size at once where the eager run holds one (GPT 111M's embedding
# looked up as ``weight[ids]``: 48 MiB predicted too many at the end of backward). The tracker runs such an op in
# place when its input is the zeros the operation before it made inside one of those formulas (the autograd node
# running, ``torch._C._current_autograd_node``: not code a recompute replays), as eager autograd does.
# See note: backward in place.
_IN_PLACE_OF = {aten.index_put.default: aten.index_put_.default, aten.scatter_add.default: aten.scatter_add_.default,
                aten.index_add.default: aten.index_add_.default}
_FORMULAS = {"IndexBackward0", "IndexSelectBackward0", "GatherBackward0"}
_ZEROS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}


def _in_formula() -> bool:
    """Whether the autograd node running now is one of ``_FORMULAS``."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() in _FORMULAS


PHASES = ("init", "forward", "backward", "step", "save")
TRAINING_PHASES = PHASES[:4]

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"}


def cpu_workspace_bytes(func: Any, out: Any) -> int:
    """Bytes a CPU kernel allocates inside itself for the length of the call, which no dispatch
    mode sees: on a CPU that emulates bf16, a bf16 matrix product (oneDNN) computes into an fp32
    buffer of the output's size, then rounds (measured: resident peak above the output = 4 bytes per
    output element for mm/addmm in bf16, none in fp16 or fp32). A CPU with ``avx512_bf16`` or AMX
    computes bf16 products without it (measured under ``ONEDNN_MAX_CPU_ISA``: AVX512_CORE 4 bytes
    per output element, AVX512_CORE_BF16 and AMX none)."""
    if (isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and func._overloadpacket.__name__ in _MATMULS
            and not native_bf16()):
        return 4 * out.numel()
    return 0


@dataclasses.dataclass
class PhasePeak:
    """The most bytes alive at once in one phase, and who held them at that moment."""

    total: int = 0
    by_category: dict[str, int] = dataclasses.field(default_factory=dict)


class MemoryTracker(EagerWhileActive, TorchDispatchMode):
    def __init__(self, ledger: Ledger, workspace: Callable[[Any, Any], int] | None = None) -> None:
        """``workspace(func, out)``: bytes the kernel of ``func`` holds inside the call (per
        accelerator; ``cpu_workspace_bytes`` for CPU), counted at that operation only. Every operation
        runs through ``MetaValues`` (``meta_values.py``: the values the meta device lacks)."""
        super().__init__()
        self.ledger = ledger
        self.workspace = workspace
        self.run_op = MetaValues()
        self.phase = "init"
        self.peaks = {p: PhasePeak() for p in PHASES}
        self.live = 0                     # bytes of every storage alive
        self._refs: dict[int, weakref.ref] = {}
        self._zeros: int | None = None    # the storage the last operation made as zeros (see _IN_PLACE_OF)
        self._size: dict[int, int] = {}
        self._saved: set[int] = set()     # storages the last forward left for backward
        self._saved_live = 0
        self._new_states = 0              # optimizer states created by a step, before the engine counts them
        self._forward_outside = 0         # bytes outside the ledger at the forward's peak
        self.saved_for_backward = 0       # bytes the last forward left for backward, outside the ledger
        self._paused = 0
        self._resize: Any = None
        self.runtime = 0                  # bytes the process holds beyond tensors (set by the estimator)
        self.routed_kernels = 0           # what full kernel caches hold, from the first routing on (set likewise)
        # (CPU: a workspace given) MKL's float products as first run, in order: host_gemm_pool.pool_bytes
        self.host_products: dict[tuple, None] = {}
        self.checkpoint_copies = 0        # bytes a checkpoint save copies (set by the estimator)
        self.category_peaks: dict[str, int] = {}  # each ledger category's peak while training (set by the estimator)

    # -- storages -------------------------------------------------------------------------------
    def _register(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return
        if ref is not None:  # a dead storage's address reused before its callback ran
            self._forget(key)
        self._refs[key] = weakref.ref(storage, functools.partial(self._died, key))
        self._size[key] = storage.nbytes()
        self.live += self._size[key]

    def _forget(self, key: int) -> None:
        n = self._size.pop(key, 0)
        self.live -= n
        if key in self._saved:
            self._saved.discard(key)
            self._saved_live -= n
        self._refs.pop(key, None)

    def _died(self, key: int, ref: weakref.ref) -> None:
        if self._refs.get(key) is ref:
            self._forget(key)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        ref = self._refs.get(key)
        if ref is None or ref() is not storage:
            return
        delta = storage.nbytes() - self._size[key]
        self._size[key] += delta
        self.live += delta
        if key in self._saved:
            self._saved_live += delta

    def __enter__(self) -> MemoryTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        return super().__enter__()  # (a compiled model's forward runs eagerly here: EagerWhileActive)

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    # -- observation ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        fresh, self._zeros = self._zeros, None
        if (fresh is not None and func in _IN_PLACE_OF and args and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage()._cdata == fresh and _in_formula()):
            func = _IN_PLACE_OF[func]  # (see _IN_PLACE_OF)
        out = self.run_op(func, args, kwargs or {})
        if func in _ZEROS and isinstance(out, torch.Tensor):
            self._zeros = out.untyped_storage()._cdata
        if self.workspace is not None and func in POOLED:
            key = signature(func, args, kwargs or {})
            if key is not None:
                self.host_products.setdefault(key)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t.untyped_storage())
        self.observe(self.workspace(func, out) if self.workspace is not None else 0)
        return out

    def observe(self, workspace: int = 0) -> None:
        """Compare what is alive now (plus a kernel's ``workspace``) with this phase's peak."""
        if self._paused:
            return
        runtime = self.runtime + (self.routed_kernels if self.run_op.routed else 0)
        total = self.live + workspace + runtime
        peak = self.peaks[self.phase]
        if total <= peak.total:
            return
        peak.total = total
        by = peak.by_category = {c.value: self.ledger.live_bytes(c) for c in Category}
        by["optim_state"] += self._new_states
        outside = max(0, self.live - self.ledger.live_bytes() - self._new_states)
        saved = min(self._saved_live, outside) if self.phase != "forward" else 0
        by["activation"] += saved
        by["temporaries"] = outside - saved + workspace
        by["runtime"] = runtime
        if self.phase == "forward":  # split at the end of forward, when it is known what stays
            self._forward_outside = outside + workspace

    # -- phases ---------------------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        self.observe()
        self.phase = phase
        self.observe()

    def end_forward(self) -> None:
        """What the ledger does not hold now is what the forward left for backward."""
        held = self.ledger.storage_keys()
        self._saved = {k for k, n in self._size.items() if k not in held and n > 0}
        self._saved_live = self.saved_for_backward = sum(self._size[k] for k in self._saved)
        self.observe()
        by = self.peaks["forward"].by_category
        if by and self._forward_outside:
            activations = min(self.saved_for_backward, self._forward_outside)
            by["activation"] = self.ledger.live_bytes(Category.ACTIVATION) + activations
            by["temporaries"] = self._forward_outside - activations
            self._forward_outside = 0

    def fused(self, optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
        """``optimizer.step`` with its temporaries uncounted (it stands in for a fused kernel the meta
        device lacks) but for an optimizer's declared ``workspace_bytes`` (stored states' chunks); the states it
        creates are labelled ``optim_state`` at the step's end, before the engine registers them."""
        step = optimizer.step

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            self._paused += 1
            try:
                return step(*args, **kwargs)
            finally:
                self._paused -= 1
                self._new_states = sum(t.untyped_storage().nbytes() for state in optimizer.state.values()
                                       for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 1
                                       and not hasattr(t, "_zeroplus_ledger_key"))
                # (stored states' chunk temporaries, as on the device predicted for: CPU where a workspace is given)
                predicted = getattr(optimizer, "predicted_workspace_bytes", None)
                self.observe(predicted(self.workspace is not None) if predicted is not None
                             else getattr(optimizer, "workspace_bytes", 0))
                self._new_states = 0
        return run
