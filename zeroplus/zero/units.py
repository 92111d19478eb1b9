"""Partition units: which parameters are flattened together.

A unit is a module whose parameters are gathered, released and reduced together. By default
every child of a ``ModuleList``/``Sequential`` whose children (two or more) share one class is a
unit (the repeated transformer blocks); ``zeroplus.unit_modules`` names classes instead. All
parameters outside any unit form the root unit (embeddings, final norm, head). A parameter that
appears in several modules (tied weights) belongs to the first unit that reaches it in module
order, and is counted once. Frozen parameters (``requires_grad=False``, or in no optimizer group) are
flattened at stage 3 into frozen groups of their unit (``Unit.frozen``: a shard in the compute dtype,
or a quantized weight's in its storage dtype (``quantized.py``), no gradient or master); at stages 0-2
they stay in place on every rank in the compute dtype.

Within a unit, parameters are split further by optimizer param group, so every flat buffer has one
set of hyper-parameters, and then into runs of at most ``reduce_bucket_size`` elements (whole
parameters; one larger than that is a run alone), one ``FlatParamGroup`` each: a group's gradient is
reduced as one piece, so a bucket smaller than a unit bounds the gradient bytes a reduction holds.
Memory: the flat gradients alive during backward are the group being filled plus the reductions in
flight (``partition.py``), so at most about two groups' gradients, each at most the bucket.
See note: flat groups; see note: reduce bucket; see note: explicit state (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from ..collectives import Handle
from ..config import ZeroStage
from .flat_group import FlatParamGroup, Joined
from .quantized import packed_storage


class UnitPass(enum.Enum):
    """Which pass a unit's gathered values serve (stage 3; its bytes are its groups' ``Residency``).

    - ``FORWARD``: gathered for (or released after) its forward; its output's first gradient gathers it again.
    - ``BACKWARD``: gathered for its backward, once per backward (a second output gradient finds it so);
      released when its gradients are all in (``GroupsDone``), or at the next unit's backward with frozen
      groups. The next forward's post-hook moves it back to ``FORWARD``."""

    FORWARD = "forward"
    BACKWARD = "backward"


def issue_joined(joined: Joined, groups_wait: bool = True) -> list[Handle]:
    """Issue each list of ``joined`` as one collective (``all_gather_joined``); with ``groups_wait`` each flat group
    in it waits on its list's handle (``FlatParamGroup.wait_pending``), else the caller does (a unit's gather).
    ``joined`` is emptied; the handles, one per list."""
    handles = []
    for (group, _), entries in joined.items():
        handle = group.all_gather_joined([(output, input) for _, output, input in entries])
        for g, _, _ in entries if groups_wait else ():
            g.gathers.append(handle)
        handles.append(handle)
    joined.clear()
    return handles


@dataclasses.dataclass
class Unit:
    """One module's flat groups and its stage-3 gather state. Its fields are written by its own methods only:
    ``keep_gathered()`` (persistent), ``start_gather``/``wait_handles``/``release`` (the handles),
    ``forward_done``/``claim_backward`` (the pass), ``begin_backward``/``group_done`` (groups whose gradients
    are in)."""

    index: int
    name: str
    module: torch.nn.Module
    groups: list[FlatParamGroup]
    is_root: bool = False
    frozen: list[FlatParamGroup] = dataclasses.field(default_factory=list)  # stage 3: its frozen parameters
    persistent: bool = dataclasses.field(default=False, init=False)  # below the persistence threshold
    gather_handles: list[Handle] = dataclasses.field(default_factory=list, init=False)
    serves: UnitPass = dataclasses.field(default=UnitPass.FORWARD, init=False)
    _groups_done: int = dataclasses.field(default=0, init=False)

    def keep_gathered(self) -> None:
        """Stage 3, a unit below ``stage3_param_persistence_threshold``: gathered now and for good (only a
        forced release, a checkpoint load's, frees it)."""
        self.persistent = True
        self.wait_gather()

    def forward_done(self) -> None:
        """Its forward ran (with gradients): the next output gradient gathers it for backward."""
        self.serves = UnitPass.FORWARD

    def claim_backward(self) -> bool:
        """The first of its outputs' gradients: True (and the unit serves its backward from now); later ones
        in the same backward: False."""
        if self.serves is UnitPass.BACKWARD:
            return False
        self.serves = UnitPass.BACKWARD
        return True

    def begin_backward(self) -> None:
        """No group's gradients are in yet."""
        self._groups_done = 0

    def group_done(self) -> bool:
        """One more of its trained groups has all its gradients; True when that was the last."""
        if self._groups_done >= len(self.groups):
            raise RuntimeError(f"unit {self.name}: {self._groups_done + 1} groups done in one backward, "
                               f"of {len(self.groups)}")
        self._groups_done += 1
        return self._groups_done == len(self.groups)

    @property
    def all_groups(self) -> list[FlatParamGroup]:
        """The trained groups and the frozen ones: what a gather fills and a release frees."""
        return self.groups + self.frozen

    @property
    def numel(self) -> int:
        return sum(g.padded_numel for g in self.all_groups)

    def start_gather(self, quantize: str | None = None) -> None:
        """Start every group's gather (``quantize``: qwZ's codes of that dtype on the wire: ``FlatParamGroup.gather``).
        """
        joined: Joined = {}  # the plain ones: one collective per group and dtype (see note: joined gathers)
        for g in self.all_groups:
            handle = g.gather(quantize, joined)
            if handle is not None:
                self.gather_handles.append(handle)
        self.gather_handles += issue_joined(joined, groups_wait=False)

    def regather(self) -> None:
        """A persistent unit after a step: its groups' new shards gathered again into their buffers (never
        released), the plain ones joined as ``start_gather`` joins them; each group waits on its own handle
        (``FlatParamGroup.wait_pending``). A resident group (one rank in fp32) has nothing to gather: its full
        buffer is its shard, the master the step wrote."""
        joined: Joined = {}
        for g in self.groups:
            if g.resident:
                continue
            if not g.join_gather(joined):
                g.gathers.append(g.all_gather_into_full())
        issue_joined(joined)

    def start_fetch(self) -> None:
        """Start bringing offloaded shards back ahead of the gather (``offload_param``)."""
        for g in self.all_groups:
            if not g.gathered:
                g.master_store.prefetch()

    def wait_handles(self) -> None:
        """Wait for the gathers already issued (a prefetch), issuing none; the parameters of the groups they
        filled then hold their values (``FlatParamGroup.expose``). Nothing issued: nothing to do (every
        gather since the last release was waited here, and exposed then)."""
        if not self.gather_handles:
            return
        for handle in self.gather_handles:
            handle.wait()
        self.gather_handles.clear()
        for g in self.all_groups:
            g.expose()

    def wait_gather(self, quantize: str | None = None) -> None:
        """Gather (unless gathered) and wait. Without ``quantize``, groups that hold qwZ's dequantized values
        are gathered again exactly (``FlatParamGroup.make_exact``): the readers of the model's values ask so."""
        self.start_gather(quantize)
        self.wait_handles()
        if not quantize:
            for g in self.all_groups:
                g.make_exact()

    def release(self, force: bool = False, keep_secondary: bool = False) -> None:
        """Free the gathered buffers (persistent units only with ``force``); ``keep_secondary``: hpZ's copy of the
        values is kept first (``FlatParamGroup.release``)."""
        if self.persistent and not force:
            return
        self.wait_handles()  # an in-flight prefetch must land before its buffer goes away
        for g in self.all_groups:
            g.release(keep_secondary)


def find_unit_modules(model: torch.nn.Module, class_names: list[str] | None,
                      frozen_too: bool = False) -> list[tuple[str, torch.nn.Module]]:
    """The (qualified name, module) of every unit other than the root, in module order; a repeated child
    with no trainable parameter is a unit only with ``frozen_too`` (stage 3 partitions frozen ones)."""
    found: list[tuple[str, torch.nn.Module]] = []
    taken: set[int] = set()

    def inside_taken(name: str) -> bool:
        return any(name == n or name.startswith(n + ".") for n, _ in found)

    if class_names is not None:
        wanted = set(class_names)
        present = {type(m).__name__ for m in model.modules()}
        missing = wanted - present
        if missing:
            raise ValueError(f"zeroplus.unit_modules names {sorted(missing)}, which the model does not contain "
                             f"(its module classes: {sorted(present)})")
        for name, module in model.named_modules():
            if name and type(module).__name__ in wanted and not inside_taken(name):
                found.append((name, module))
        return found
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or inside_taken(name):
            continue
        children = list(module.named_children())
        classes = {type(c) for _, c in children}
        if len(children) >= 2 and len(classes) == 1 and id(module) not in taken:
            for child_name, child in children:
                if any(p.requires_grad or frozen_too for p in child.parameters()):
                    found.append((f"{name}.{child_name}" if name else child_name, child))
            taken.add(id(module))
    return found


Named = list[tuple[str, torch.nn.Parameter]]


def assign_parameters(model: torch.nn.Module, unit_modules: list[tuple[str, torch.nn.Module]],
                      frozen_too: bool = False) -> list[tuple[str, torch.nn.Module, Named]]:
    """Trainable parameters per unit (``frozen_too``: every parameter), root last; each parameter once
    (tied weights deduplicated)."""
    seen: set[int] = set()
    units: list[tuple[str, torch.nn.Module, Named]] = []
    for name, module in unit_modules:
        params = []
        for pname, p in module.named_parameters():
            if (p.requires_grad or frozen_too) and id(p) not in seen:
                seen.add(id(p))
                params.append((f"{name}.{pname}", p))
        units.append((name, module, params))
    root_params = []
    for pname, p in model.named_parameters():
        if (p.requires_grad or frozen_too) and id(p) not in seen:
            seen.add(id(p))
            root_params.append((pname, p))
    units.append(("<root>", model, root_params))
    return units


def frozen_dtype(p: torch.nn.Parameter, stage: ZeroStage, experts: Any,
                 compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of the frozen group a parameter no optimizer trains is flattened into, or None (it stays
    whole where it is): at stage 3, a plain floating-point ``Parameter`` in ``compute_dtype``; a quantized
    weight whose storage packs codes (``quantized.py``: QLoRA's 4-bit base) as its raw storage dtype; any
    other ``Parameter`` subclass stays whole (its storage may hold what a cast or a copy would corrupt), as
    does an expert's parameter split over ranks."""
    if not stage.shards_parameters or (experts is not None and experts.holds(p)):
        return None
    if type(p) is torch.nn.Parameter and p.is_floating_point():
        return compute_dtype
    return p.dtype if packed_storage(p) else None


def bucketed(named: list[tuple[str, torch.nn.Parameter]], limit: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """``named`` in order, cut into runs of at most ``limit`` elements (a larger parameter is a run alone)."""
    runs: list[list[tuple[str, torch.nn.Parameter]]] = []
    size = 0
    for name, p in named:
        if not runs or size + p.numel() > limit:
            runs.append([])
            size = 0
        runs[-1].append((name, p))
        size += p.numel()
    return runs
