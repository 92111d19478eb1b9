"""``engine.offload_states()`` / ``reload_states()``: the training states off the device and back.

RL frameworks share the device between the trained model and an inference server: between steps
they call ``offload_states()`` (DeepSpeed's name and keywords), generate, then ``reload_states()``.
Each kind DeepSpeed names (``OffloadStateTypeEnum``) maps to the engine's tensors:

=========================  ===============================================================
``optim_states``           the optimizer's states of every flat group's owned range
``hp_params``              the fp32 masters (and shared-master residuals)
``lp_params``              the compute-dtype parameters: stages 0-2's flat buffers, stage 3's
                           low-precision and frozen shards
``lp_grads``,              the flat gradient buffers that exist (none between steps unless
``contiguous_grad_buffer`` micro-batches are being accumulated)
=========================  ===============================================================

Mechanism: each selected tensor's *storage* is copied to a host buffer (pinned when asked and the
device allows it) and resized to 0 bytes on the device; reloading resizes it back and copies the
bytes in. Every view of a storage (parameters over a flat buffer, a master that is a slice of one)
stays the same object throughout, so nothing is rebuilt and the round trip is bit-exact. A storage is
moved once however many kinds name it (in fp32 at stages 0-2 the master is the parameters' buffer).
States already on a lower tier (``offload_optimizer``, ``offload_param``) are not on the device and
are left alone. While offloaded, ``forward``, ``backward`` and ``step`` are errors naming
``reload_states()``. Memory: the moved bytes leave the device (the ledger shows them gone) and are
held on the host until reloaded; on a machine without an accelerator host and device are one memory
and the move only frees and re-allocates it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from .accessors import EngineAccessors as Engine  # the readings of an engine it uses

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


def _kinds(include: Iterable[Any] | None) -> set[str]:
    """DeepSpeed's ``OffloadStateTypeEnum`` members or their names; None: every kind."""
    if include is None:
        return set(KINDS)
    names = {str(getattr(k, "value", k)) for k in include}
    unknown = sorted(names - set(KINDS))
    if unknown:
        raise ValueError(f"offload_states(include=...): unknown state kinds {unknown}; the kinds are {list(KINDS)}")
    return names


def _tensors(engine: Engine, kinds: set[str]) -> list[torch.Tensor]:
    part, device = engine.partition, engine.accelerator.device()
    out: list[torch.Tensor | None] = []
    for g in part.groups:
        if "optim_states" in kinds:
            out += [v for v in engine.optimizer.state.get(g.master_param, {}).values()
                    if isinstance(v, torch.Tensor) and v.numel() > 1]
        if "hp_params" in kinds:
            out += [g.master, getattr(g.master_store, "low", None)]
        if "lp_params" in kinds:
            out += [g.shard, None if g.stage.shards_parameters else g.full]
        if kinds & {"lp_grads", "contiguous_grad_buffer"}:
            out += [g.gradient.flat, g.gradient.reduced, *g.gradient.kept]
    if "lp_params" in kinds:
        out += [t for g in part.frozen for t in (g.shard, getattr(g.master_store, "codes", None),
                                                   getattr(g.master_store, "scales", None))]
    return [t for t in out if t is not None and t.device == device and t.untyped_storage().nbytes() > 0]


class StateOffload:
    """What one engine has moved off its device, and moving it back."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.held: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # (tensors over one storage, host bytes)

    @property
    def offloaded(self) -> bool:
        return bool(self.held)

    def offload(self, include: Iterable[Any] | None, pin_memory: bool, non_blocking: bool) -> int:
        """Move the kinds in ``include``; returns the bytes moved. An error if states are already off."""
        if self.held:
            raise RuntimeError(f"offload_states() on rank {self.engine.dp.rank}: the states are offloaded already; "
                               f"call reload_states() first")
        kinds = _kinds(include)
        self.engine.partition.wait_in_flight()
        by_storage: dict[int, list[torch.Tensor]] = {}
        for t in _tensors(self.engine, kinds):
            by_storage.setdefault(t.untyped_storage()._cdata, []).append(t)
        pin = pin_memory and self.engine.accelerator.device().type != "cpu"
        moved = 0
        with torch.no_grad():
            for tensors in by_storage.values():
                storage = tensors[0].untyped_storage()
                device_bytes = _bytes_of(storage)
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(device_bytes, non_blocking=non_blocking)
                if non_blocking:
                    self.engine.accelerator.synchronize()
                storage.resize_(0)
                self._resized(tensors)
                self.held.append((tensors, host))
                moved += host.numel()
        self._kept_resized()
        return moved

    def reload(self, non_blocking: bool) -> int:
        """Move everything back, bit for bit; returns the bytes moved (0 when nothing was offloaded)."""
        moved = 0
        with torch.no_grad():
            for tensors, host in self.held:
                storage = tensors[0].untyped_storage()
                storage.resize_(host.numel())
                _bytes_of(storage).copy_(host, non_blocking=non_blocking)
                self._resized(tensors)
                moved += host.numel()
        if non_blocking and self.held:
            self.engine.accelerator.synchronize()
        self.held = []
        self._kept_resized()
        return moved

    def _resized(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if hasattr(t, "_zeroplus_ledger_key"):
                self.engine.ledger.resized(t)

    def _kept_resized(self) -> None:  # one rank's kept gradients: one ledger entry per group, no mark on each
        for g in self.engine.partition.groups:
            g.gradient.kept.resized()

    def refuse_if_offloaded(self, call: str) -> None:
        if self.held:
            raise RuntimeError(f"{call} on rank {self.engine.dp.rank}: the training states are offloaded "
                               f"(offload_states()); call reload_states() first")


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
