"""Stage-3 parameter lifecycle: gather before use, prefetch ahead, release after use.

Forward: a pre-hook on each unit's module waits for its all-gather (issuing it if no prefetch
did), then issues the all-gathers of the next units in the recorded forward order until
``stage3_prefetch_bucket_size`` elements are in flight (at least one unit; unset: exactly one).
After each optimizer step the root unit and the first unit are gathered ahead for the next
forward. A post-hook releases
the unit (its storage is resized to 0) and hooks the unit's output tensors so that, when their
gradient arrives, the unit is gathered again for its backward and the units before it are
prefetched. A unit is released in backward as soon as all its gradients have arrived (the
partition calls ``on_unit_grads_done``), unless it holds frozen parameters: their values are read
for the gradient of the unit's input, which may come after the unit's own gradients, so such a unit
is released when the next unit's backward starts (its output's gradient is then complete, so every
use inside the unit that feeds it has run) or at the end of backward. The root unit (parameters
outside any repeated block, such as tied embeddings) stays gathered from the start of forward to
the end of backward (or until its gradients are all in, ``partition.py``'s early root release; its plain
embeddings' groups only to the forward's end, ``ZeroPartition.after_forward``), and
units below ``stage3_param_persistence_threshold`` elements stay gathered for good.

Activation checkpointing replays a unit's forward inside backward: the replay gathers the unit
(if not gathered) and keeps it until its gradients are done, without prefetching forward.

With ``offload_param`` the unit after the last one gathered ahead also starts reading its shards
from the tier (``tiered_master.py``), so the read overlaps compute and its gather finds them.

Peak gathered memory: the root unit, plus the unit computing, plus the prefetch window. On a CPU rank a released
unit's bytes are parked for the next gather of their size in the same pass instead of going back to the kernel
(``buffer_pool.py``: the pool is open from a forward's start to its last gather, and through a backward).
Communication: every non-persistent unit is all-gathered twice per step (forward, backward); under hpZ all but each
step's first forward gather run within the secondary group (``flat_group.py``; see note: hpz), and under qwZ the
gathers issued here carry int8 codes (``quantized_comm.py``; see note: qwz).
See note: prefetch (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import fault_dumps
from ..eager import eager, in_backward
from .buffer_pool import BufferPool
from .units import Unit


class Stage3Scheduler:
    def __init__(self, units: list[Unit], root: Unit, prefetch_numel: int | None, pool: BufferPool,
                 hooked: bool = True, quantize: str | None = None) -> None:
        """``prefetch_numel``: elements gathered ahead of use; ``None`` means one unit ahead. ``hooked`` false: one
        rank with every group resident (``FlatParamGroup.resident``): nothing is ever gathered or released, so no unit
        gets a hook; a fault dump finds the unit computing on the error's stack (``fault_dumps.name_units``: a naming
        hook alone cost about 4 us a unit, a whole forward's 12 blocks about 50 us of a host-bound step).
        ``quantize`` (qwZ): the gathers issued here carry codes of that dtype (``quantized_comm.WEIGHT_DTYPES``);
        the persistent units' and those for reading the model (``state_dict``, ``GatheredParameters``, ``destroy``)
        stay exact."""
        self.quantize = quantize
        self.units = units
        self.root = root
        self.prefetch_numel = prefetch_numel
        self.pool = pool  # open in a forward with gradients until its last gather starts (see note: buffer pool)
        self.forward_order: list[int] = []
        self._recording: list[int] = []
        self._held: list[Unit] = []  # units with frozen groups gathered for backward, released at the next one
        self.paused = False  # the module hooks do nothing (TRL generating from a model gathered whole): pause()
        self._handles: list[Any] = []
        if not hooked:
            fault_dumps.name_units({u.module: u.name for u in units})
        for unit in units if hooked else []:
            self._handles.append(unit.module.register_forward_pre_hook(eager(self._make_pre_forward(unit))))
            self._handles.append(unit.module.register_forward_hook(eager(self._make_post_forward(unit))))

    @property
    def hooked(self) -> bool:
        """Whether the units' modules carry this scheduler's gather and release hooks (not at one rank in fp32,
        where nothing moves, nor after ``remove``)."""
        return bool(self._handles)

    def pause(self, paused: bool) -> None:
        """``True``: the module hooks do nothing until ``pause(False)`` (DeepSpeed's hook removal and
        re-registration around TRL's generation: ``deepspeed_api/parameter_offload.py``)."""
        self.paused = paused

    # -- forward ------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._recording = []
        self.root.wait_gather(self.quantize)
        if torch.is_grad_enabled():
            self.pool.open("forward")

    def end_forward(self) -> None:
        self.pool.close()
        if self._recording:
            self.forward_order = self._recording
        if not torch.is_grad_enabled():
            self.root.release()

    def _prefetch(self, order: list[int], start: int) -> None:
        budget = 1 if self.prefetch_numel is None else self.prefetch_numel
        position = start
        for position in range(start, len(order)):
            unit = self.units[order[position]]
            unit.start_gather(self.quantize)
            budget -= 1 if self.prefetch_numel is None else unit.numel
            if budget <= 0:
                break
        if position + 1 == len(order) and not in_backward():  # the forward's last gather: no more takers
            self.pool.close()
        if position + 1 < len(order):  # offloaded shards: the read runs one unit ahead of the gather
            self.units[order[position + 1]].start_fetch()

    def prefetch_for_next_forward(self) -> None:
        """After a step: start gathering the root unit and the first unit(s) of the next forward,
        so their all-gathers overlap whatever runs between steps (data loading, logging)."""
        self.root.start_gather(self.quantize)
        if self.forward_order and self.prefetch_numel != 0:
            self._prefetch(self.forward_order, 0)

    def _make_pre_forward(self, unit: Unit):
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self.paused:
                return
            fault_dumps.set_unit(unit.name)
            unit.wait_gather(self.quantize)
            if in_backward():  # an activation-checkpoint replay: gathered for its backward
                self._hold(unit)
                return
            self._recording.append(unit.index)
            order = self.forward_order
            if order and unit.index in order and self.prefetch_numel != 0:
                self._prefetch(order, order.index(unit.index) + 1)
        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self.paused or in_backward():  # (a replay's backward follows at once; released when its
                return output                  # grads are done)
            if torch.is_grad_enabled():
                unit.forward_done()
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
            unit.release(keep_secondary=torch.is_grad_enabled())  # (hpZ: its backward gathers within the node)
            return output
        return hook

    # -- backward -----------------------------------------------------------------------------
    def _make_pre_backward(self, unit: Unit):
        def hook(grad: torch.Tensor) -> None:
            if not unit.claim_backward():
                return None
            self._hold(unit)
            fault_dumps.set_unit(unit.name)
            unit.wait_gather(self.quantize)
            order = list(reversed(self.forward_order))
            if unit.index in order and self.prefetch_numel != 0:
                self._prefetch(order, order.index(unit.index) + 1)
            return None
        return hook

    def _hold(self, unit: Unit) -> None:
        """``unit`` starts its backward: the units with frozen groups held so far are done (see above)."""
        for held in self._held:
            if held is not unit:
                held.release()
        self._held = [unit] if unit.frozen and unit is not self.root else []

    def on_unit_grads_done(self, unit: Unit) -> None:
        if unit is not self.root and not unit.frozen:
            unit.release()

    def end_backward(self) -> None:
        self._held = []
        for unit in self.units:
            unit.release()
        self.root.release()

    def refresh_persistent(self) -> None:
        """After a step, persistent units re-gather the new shards (they are never released)."""
        for unit in self.units + [self.root]:
            if unit.persistent:
                unit.regather()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ResidentScheduler(Stage3Scheduler):
    """Stage 3 at one rank with every group resident (``FlatParamGroup.resident``, one rank in fp32): nothing is ever
    gathered or released, so no forward, backward or step has anything to schedule, and these make no pass over the
    units (gathers and releases that would return at once: within the launch-to-launch spread of the one-rank
    stand-in, under 20 us a step). The scheduler stays for what reads, names or pauses the model (state-dict hooks,
    ``GatheredParameters``, fault dumps). Chosen when the partition is assembled; see note: one-rank take at once."""

    def __init__(self, units: list[Unit], root: Unit, prefetch_numel: int | None, pool: BufferPool,
                 quantize: str | None = None) -> None:
        super().__init__(units, root, prefetch_numel, pool, hooked=False, quantize=quantize)

    def begin_forward(self) -> None:
        pass

    def end_forward(self) -> None:
        pass

    def on_unit_grads_done(self, unit: Unit) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def refresh_persistent(self) -> None:
        pass

    def prefetch_for_next_forward(self) -> None:
        pass
