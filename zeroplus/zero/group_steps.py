"""One flat group's optimizer step, an object chosen once when the engine is assembled (``ShardedStep``).

Where a group's master and optimizer states live decides how it steps, and none of that changes after assembly:

- ``WholeStep``: the owned fp32 master is one tensor the optimizer steps as a parameter (the common case);
- ``ChunkedMasterStep``: the master is split into bf16 halves and residuals (shared-storage master weights) or lives
  on a tier (parameter offload), so it is read, stepped and written back chunk by chunk (``chunked_step.py``);
- ``TieredStatesStep``: the optimizer states are offloaded, stepped sub-group by sub-group as their tier streams
  them (``chunked_step.step_tiered``, ``offload/optimizer_states.py``);
- ``VirtualStep``: the master and states sit in swapped host memory, stepped by its own kernel
  (``offload/virtual_host.py``), which takes the step's coefficient as a multiplier, not torch's fused divide.

Each holds how its states are read and replaced for a checkpoint (``state``, ``load``). Memory: none of its own;
what each path allocates is in the module it calls. See note: group steps (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from ..ledger import Category, Ledger
from ..offload.optimizer_states import TieredStates
from ..offload.virtual_host import VirtualStates
from ..optim.stored_states import StoredStates
from .chunked_step import ChunkedStep
from .flat_group import FlatParamGroup
from .master_store import FullMaster


class GroupStep(Protocol):
    """How one flat group steps. ``own_kernel``: its kernel is not torch's, so the fused kernel's divide does not
    reach it and its gradient is multiplied by the step's coefficient first."""

    own_kernel: bool

    def step(self, g: FlatParamGroup, grad: torch.Tensor) -> None: ...

    def state(self, g: FlatParamGroup) -> dict[str, Any]: ...

    def load(self, g: FlatParamGroup, state: dict[str, Any]) -> None: ...


class WholeStep:
    """The optimizer steps the owned fp32 master as one parameter; torch's lazily created states go into the
    ledger (``optim_state``) right after the step that creates them."""

    own_kernel = False

    def __init__(self, optimizer: torch.optim.Optimizer, ledger: Ledger) -> None:
        self.optimizer, self.ledger = optimizer, ledger

    def step(self, g: FlatParamGroup, grad: torch.Tensor) -> None:
        g.master_param.grad = grad
        self.optimizer.step()
        g.master_param.grad = None
        self.ledger.track_new_states(self.optimizer.state.get(g.master_param, {}), Category.OPTIM_STATE)

    def state(self, g: FlatParamGroup) -> dict[str, Any]:
        """One value per element for every per-element state (fp8 moments dequantized: ``per_element``)."""
        state = self.optimizer.state.get(g.master_param, {})
        return self.optimizer.per_element(state) if isinstance(self.optimizer, StoredStates) else state

    def load(self, g: FlatParamGroup, state: dict[str, Any]) -> None:
        if isinstance(self.optimizer, StoredStates):
            state = self.optimizer.from_per_element(state)
            self.ledger.track_new_states(state, Category.OPTIM_STATE)
        self.optimizer.state[g.master_param] = state


class ChunkedMasterStep(WholeStep):
    """A split or tiered master, stepped chunk by chunk; its states are the optimizer's own, full size."""

    def __init__(self, optimizer: torch.optim.Optimizer, ledger: Ledger, chunked: ChunkedStep) -> None:
        super().__init__(optimizer, ledger)
        self.chunked = chunked

    def step(self, g: FlatParamGroup, grad: torch.Tensor) -> None:
        self.chunked.step(g, grad)


class TieredStatesStep:
    """Optimizer states on a lower tier, stepped sub-group by sub-group as they stream in."""

    own_kernel = False

    def __init__(self, chunked: ChunkedStep, states: TieredStates) -> None:
        self.chunked, self.states = chunked, states

    def step(self, g: FlatParamGroup, grad: torch.Tensor) -> None:
        self.chunked.step_tiered(g, self.states, grad)

    def state(self, g: FlatParamGroup) -> dict[str, Any]:
        """One value per element for every per-element state, each sub-group's fp8 moments dequantized."""
        optimizer = self.chunked.optimizer
        form = optimizer.per_element if isinstance(optimizer, StoredStates) else None
        return self.states.full(g.owned_numel, form)

    def load(self, g: FlatParamGroup, state: dict[str, Any]) -> None:
        """Each sub-group's slice of ``state``, its fp8 moments quantized with the sub-group's blocks (the shard's:
        sub-groups start at multiples of the block)."""
        optimizer = self.chunked.optimizer
        form = optimizer.from_per_element if isinstance(optimizer, StoredStates) else None
        self.states.load_full(state, g.owned_numel, form)


class VirtualStep:
    """The master and states in swapped host memory, stepped in place by their own kernel."""

    own_kernel = True

    def __init__(self, states: VirtualStates, options: dict[str, Any]) -> None:
        self.states, self.options = states, options  # options: the optimizer's param group of the master

    def step(self, g: FlatParamGroup, grad: torch.Tensor) -> None:
        self.states.step(_whole_master(g), grad, self.options)

    def state(self, g: FlatParamGroup) -> dict[str, Any]:
        return self.states.state()

    def load(self, g: FlatParamGroup, state: dict[str, Any]) -> None:
        self.states.load(state)


def _whole_master(g: FlatParamGroup) -> torch.Tensor:
    """The resident fp32 master of ``g`` (virtual host memory steps it in place)."""
    store = g.master_store
    if not isinstance(store, FullMaster):
        raise TypeError(f"{g.name}: virtual host memory steps a resident fp32 master, not {type(store).__name__}")
    return store.tensor
