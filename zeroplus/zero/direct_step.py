"""One rank: the step over each parameter's own gradient, as the plain module's optimizer runs it.

At world size 1 in fp32 (``GroupGrad.keeps``) nothing is reduced, so the flat gradient
buffer is only a copy: each gradient written once more (read 4 * P, write 4 * P bytes per step) for
a step that could read it where it is. Here the gradients stay where autograd put them
(``GroupGrad.keep``, counted in the ledger as ``grad``: 4 * P, as the flat buffer was), and
the optimizer steps them against views: each parameter's slice of the flat fp32 master (the
parameters' own storage: the model's parameters themselves are stepped, their kept gradients still in
their ``.grad``, see note: one-rank grads in place) and of every flat optimizer state, so the states stay
one flat tensor per group for checkpoints, offload and the memory report. A group whose gradients went
into the flat buffer after all (an embedding's rows, a tied weight's uses, a parameter with no gradient) steps the
same way over views of that buffer. Extra memory: none (views), and one small step count per parameter; extra
time: the views are made once and kept (``_Views``) while the master and the flat states are the same tensors
at the same addresses; after each step the group's step count is the first view's own tensor (no copy), and it
is copied into the views (one call) only when something other than this step wrote it (its version counter
moved: a checkpoint, a user's reset).

The gradient norm is ``clip_grad_norm_``'s, formed as it forms it: one fp32 norm per gradient (``torch._foreach_norm``)
and the norm of those (``ShardedStep._lone_root``): at one rank no sharding exists whose float64 sum it would have to
agree with, and it takes three kernels where the squares in float64 and their root take five.

Exactness: torch's fused CPU kernels treat each tensor's last few elements (a scalar tail) apart, an ulp
away from the vector lanes, so a flat step differs from the plain module's per-parameter step there. Stepping
per parameter makes one rank's update the plain module's bit for bit (same gradients, same kernel over the
same tensors) when clipping does not bind; a binding clip scales by the same norm's coefficient, applied in the
fused kernel as a division by its inverse (``kernel_scale.py``: within an ulp of ``clip_grad_norm_``'s product).

A binding clip (or a loss scale) is applied inside the fused Adam kernel where it can be (``kernel_scale.py``):
no pass of its own over the gradients.

When it applies (``DirectStep.grads``): torch's elementwise optimizers and Adam/AdamW with stored states
(``optim/stored_states.py``, its moments made here in their dtypes) only (``ELEMENTWISE``: one element's
update reads only that element, so a slice steps as the flat tensor would); the group's states exist before the
step (Adam and AdamW's are made here as torch makes them, zeros and a step count; SGD with momentum makes
its buffer from the first gradient, so its first step is flat); no model-parallel weighting of the norm, no
offloaded states. See note: one-rank gradients; see note: one-rank step bookkeeping (docs/design-notes.md).

fp8 moments (a scale per block of the flat group, and a block may span two parameters, so no view holds whole
blocks): each group steps whole, its master and states as the flat step has them, over its kept gradients handed
to the step as segments at the parameters' offsets (``_step_segments``, ``StoredStates.given``): the flat step's
values with no flat gradient buffer and no copy into one. See note: one-rank fp8 segments.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from typing import Any

import torch

from ..kernels.native_adam import GradientSegments
from ..ledger import Category, Ledger
from ..optim.stored_states import StoredStates
from .flat_group import FlatParamGroup
from .kernel_scale import divided_in_kernel, scales_in_kernel

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def squared_norm(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Sum of the squares of ``grads``' elements in ``dtype``: one norm per tensor in its own dtype (torch's
    ``clip_grad_norm_``), the squares summed in ``dtype``."""
    norms = torch._foreach_norm(grads, 2.0)
    return torch.stack(norms).to(dtype).square().sum()


class DirectStep:
    """Steps the flat groups that keep their gradients (one rank, fp32) through per-parameter views."""

    def __init__(self, optimizer: torch.optim.Optimizer, options: dict[int, dict[str, Any]], ledger: Ledger,
                 piece_numel: int = 1 << 20) -> None:
        """``options``: the optimizer's param group of each master parameter, by id. ``piece_numel``: where the
        optimizer is not fused, a parameter of more elements is stepped as pieces of at most this many (see
        ``_Views``)."""
        self.optimizer = optimizer
        self.options = options
        self.ledger = ledger
        # whole multiples of 1024 elements: every piece but a parameter's last ends on a boundary of the vector loops
        self.piece_numel = max(1024, piece_numel // 1024 * 1024)
        # fp8 moments: a block of 128 may span two parameters, so no view of a parameter holds whole blocks; the
        # flat group steps whole over its parameters' kept gradients as segments (``_step_segments``)
        self.segmented = isinstance(optimizer, StoredStates) and optimizer.block_scaled
        self.enabled = type(optimizer) in ELEMENTWISE or isinstance(optimizer, StoredStates)
        self._made: dict[int, _Views] = {}  # id(group) -> its views, while their tensors stand
        self._gave_grad: list[torch.Tensor] = []  # views whose .grad this step set (cleared after it)

    def declare_segments(self, groups: list[FlatParamGroup]) -> None:
        """When the engine is assembled (``enabled`` settled): where this step will hand fp8 groups their kept
        gradients as segments (a group keeps them: one rank), the optimizer is told, so its step's scratch and
        ``workspace_bytes`` include the row a gathered chunk of them takes."""
        if self.enabled and self.segmented and any(g.gradient.keeps for g in groups):
            assert isinstance(self.optimizer, StoredStates)
            self.optimizer.takes_gradient_segments = True

    def grads(self, g: FlatParamGroup) -> list[torch.Tensor] | None:
        """``g``'s gradients, one tensor per parameter, when this step takes the group: the kept ones (fp8
        moments: each contiguous, handed to the step as segments), or views of the flat (stages 1-3: reduced)
        gradient they went into. None: the flat step takes it, with any kept gradient moved into the flat buffer
        first (``settle_kept``)."""
        if not (self.enabled and g.gradient.keeps and (self.segmented or self._states_ready(g))):
            g.gradient.settle_kept()
            return None
        kept = g.gradient.kept_whole()
        if kept is not None and (not self.segmented or all(t.is_contiguous() for t in kept)):
            return kept
        g.gradient.settle_kept()
        # (fp8: a gradient in rows, or one laid out otherwise, goes into the flat buffer for the flat step)
        return None if self.segmented else g.step_gradient_views()

    def _states_ready(self, g: FlatParamGroup) -> bool:
        """Whether ``g``'s optimizer states exist as flat tensors before the step (made here for Adam and AdamW
        as torch makes them: ``step`` a 0-d count, on the device for the fused and capturable kernels, the
        moments zeros; ledger: ``optim_state``)."""
        p = g.master_param
        if self.optimizer.state.get(p):
            return True
        options = self.options[id(p)]
        if type(self.optimizer) is torch.optim.SGD:
            return not options.get("momentum")
        stored = self.optimizer.state_dtypes if isinstance(self.optimizer, StoredStates) else {}
        if type(self.optimizer) not in (torch.optim.Adam, torch.optim.AdamW) and not stored:
            return False
        on_device = options.get("fused") or options.get("capturable")
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state: dict[str, Any] = {"step": torch.zeros((), dtype=scalar, device=p.device if on_device else "cpu")}
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if options.get("amsgrad") else ()):
            state[key] = self.ledger.zeros(p.numel(), stored.get(key, p.dtype), Category.OPTIM_STATE, p.device)
        self.optimizer.state[p] = state
        return True

    def step(self, work: list[tuple[FlatParamGroup, list[torch.Tensor]]], coef: float | None) -> None:
        """One optimizer step of every group in ``work`` over its gradients scaled by ``coef``; each group's flat
        states are updated in place and its step count advanced once. ``coef`` None: the caller has handed the
        kernel its scalars (``kernel_scale.scalars_in_kernel``). A fused optimizer takes every group in one call
        (one kernel launch per param group, no temporaries); any other runs one call per flat group, as the flat
        step does: torch's foreach kernels make temporaries the size of every tensor in a call (an AdamW of the
        user's at one rank held 137 MiB more than the config's fused one on GPT 111M), and elementwise kernels
        give the same values however the tensors are grouped."""
        if not work:
            return
        in_kernel = coef is not None and scales_in_kernel(self.optimizer, coef)
        if coef is not None and coef != 1.0 and not in_kernel:
            torch._foreach_mul_([t for _, grads in work for t in grads], coef)
        fused = all(pg.get("fused") for pg in self.optimizer.param_groups)
        with divided_in_kernel(self.optimizer, coef, work[0][1][0].device) if in_kernel and coef is not None \
                else nullcontext():
            if self.segmented:
                self._step_segments(work)
                return
            for call in [work] if fused else [[one] for one in work]:
                self._call(call)

    def _step_segments(self, work: list[tuple[FlatParamGroup, list[torch.Tensor]]]) -> None:
        """One ``optimizer.step()`` over the flat masters of ``work``'s groups, each given its kept gradients as
        segments at the parameters' offsets (``StoredStates.given``: the flat step's values, with no flat
        gradient buffer and no copy into one); the states it makes go into the ledger as the flat step's do."""
        assert isinstance(self.optimizer, StoredStates)
        given: dict[torch.Tensor, GradientSegments] = {
            g.master_param: GradientSegments(grads, g.offsets, g.master_param.numel()) for g, grads in work}
        with self.optimizer.given(given):  # (every other master has no gradient now: the step skips it)
            self.optimizer.step()
        for g, _ in work:
            self.ledger.track_new_states(self.optimizer.state.get(g.master_param, {}), Category.OPTIM_STATE)

    def _call(self, work: list[tuple[FlatParamGroup, list[torch.Tensor]]]) -> None:
        """One ``optimizer.step()`` over the views of ``work``'s groups. For the call the optimizer's param groups
        hold the views and its ``state`` is a dict of the views' states alone (their ``_Views.state_of``, merged
        without hashing a tensor again): no entry is added to the optimizer's own state and taken out after."""
        swapped: dict[int, tuple[dict[str, Any], list[torch.Tensor]]] = {}  # id(param group) -> (it, its views)
        made = []
        state_of: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for g, grads in work:
            group_views = self._views(g, grads)
            options = self.options[id(g.master_param)]
            swapped.setdefault(id(options), (options, []))[1].extend(group_views.views)
            state_of.update(group_views.state_of)
            made.append((g, group_views))
        saved = {key: options["params"] for key, (options, _) in swapped.items()}
        own = self.optimizer.state
        try:
            for options, views in swapped.values():  # groups with no direct work keep masters with no gradient:
                options["params"] = views  # torch skips them
            self.optimizer.state = state_of
            self.optimizer.step()
        finally:
            self.optimizer.state = own
            for key, (options, _) in swapped.items():
                options["params"] = saved[key]
            for g, done in made:
                state, first = own[g.master_param], done.states[0]
                for k in done.scalars:  # the rest (the step count): every view advanced its own copy alike, so the
                    state[k] = first[k]  # group's is the first view's own tensor from now on (no copy kernel)
                    if isinstance(first[k], torch.Tensor):
                        done.versions[k] = first[k]._version  # (as the views hold it: ``sync`` has nothing to copy)
            for view in self._gave_grad:  # (a kept gradient still in its parameter's .grad goes when it is dropped)
                view.grad = None
            self._gave_grad = []

    def forget(self, g: FlatParamGroup) -> None:
        """Drop ``g``'s views (its states are being replaced: the views would keep the old ones alive)."""
        self._made.pop(id(g), None)

    def _views(self, g: FlatParamGroup, grads: list[torch.Tensor]) -> _Views:
        """One parameter per tensor of ``g``: its slice of the flat master, with its gradient and its slices of
        the flat states (scalar states as the group's now)."""
        state = self.optimizer.state[g.master_param]
        made = self._made.get(id(g))
        if made is None or not made.stands(g.master_param, state):
            whole = self.options[id(g.master_param)].get("fused") or type(self.optimizer) not in ELEMENTWISE
            made = self._made[id(g)] = _Views(g, state, None if whole else self.piece_numel)
        made.sync(state)
        for view, grad in zip(made.views, made.pieces_of(grads)):
            if view.grad is not grad:  # (a parameter's own kept gradient is there already: kept_grads.py)
                view.grad = grad
                self._gave_grad.append(view)
        return made


class _Views:
    """A group's per-parameter views and their optimizer states, made once: the master's slices (the model's own
    parameters where they are those slices: one rank's fp32 alias), the flat states' slices, and a copy of each
    other state (a step count) that ``sync`` sets to the group's.

    ``piece_numel`` (an optimizer that is not fused): a parameter of more elements is stepped as consecutive 1-D
    pieces of that many (its last the rest), each a view with its gradient's and its states' same pieces. Such an
    optimizer's temporaries are the size of the tensors it steps (torch's for-loop Adam holds two the size of the
    largest: 96 MiB for GPT 111M's embedding), so they are then at most the pieces'. Its kernels are elementwise,
    and every piece but the last ends on a multiple of 1024 elements, where no vector loop of a whole tensor has a
    tail: each element goes through the same loop, vector or scalar, as in the whole parameter, so the values are
    the whole parameter's bit for bit. (A fused kernel treats each tensor's last elements apart: its parameters
    stay whole, and it makes no temporaries anyway.) See note: one-rank step pieces."""

    def __init__(self, g: FlatParamGroup, state: dict[str, Any], piece_numel: int | None = None) -> None:
        flat = _flat_states(state, g.master_param.numel())
        master = g.master_param.detach()
        self.views: list[torch.Tensor] = []
        self.states: list[dict[str, Any]] = []
        # each view's parameter index and its slice of the parameter's elements (None: the whole parameter), where
        # a parameter is in pieces; None: every parameter whole
        self._pieces: list[tuple[int, slice | None]] | None = None
        for i, (p, off, n, shape) in enumerate(zip(g.params, g.offsets, g.numels, g.shapes)):
            if piece_numel is not None and n > piece_numel:
                if self._pieces is None:
                    self._pieces = [(j, None) for j in range(i)]  # (the parameters before: whole)
                for a in range(0, n, piece_numel):
                    b = min(n, a + piece_numel)
                    self.views.append(torch.nn.Parameter(master[off + a:off + b], requires_grad=False))
                    self.states.append(_state_piece(state, flat, off + a, off + b, (b - a,)))
                    self._pieces.append((i, slice(a, b)))
                continue
            piece = master[off:off + n].view(shape)
            self.views.append(p if _same(p, piece) else torch.nn.Parameter(piece, requires_grad=False))
            self.states.append(_state_piece(state, flat, off, off + n, shape))
            if self._pieces is not None:
                self._pieces.append((i, None))
        self.scalars = [k for k in state if k not in flat]
        self.state_of = dict(zip(self.views, self.states))  # the optimizer's ``state`` for the step (``_call``)
        # each scalar state tensor's version counter when the views last held its value (none yet: copied)
        self.versions: dict[str, int] = {}
        # what the views depend on: the master (object, address, size), each flat state (object, address, size),
        # the states' names (a step count is copied into the views by value: ``sync``; the group's own becomes the
        # first view's after each step), and the address of each parameter stepped as itself (it must still be
        # the master's slice)
        self._master = (g.master_param, g.master_param.data_ptr(), g.master_param.numel())
        self._names = list(state)
        self._flat = [(k, t, t.data_ptr(), t.numel()) for k, t in flat.items()]
        params = {id(p) for p in g.params}
        self._own = [view for view in self.views if id(view) in params]  # (the parameters stepped as themselves)
        self._addresses = list(map(torch.Tensor.data_ptr, self._own))

    def pieces_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of ``views``, in their order: each parameter's (``grads``), or its pieces."""
        if self._pieces is None:
            return grads
        return [grads[i] if part is None else grads[i].reshape(-1)[part] for i, part in self._pieces]

    def stands(self, master: torch.Tensor, state: dict[str, Any]) -> bool:
        """Whether the master and the states are still the tensors (and addresses) the views were made over, and
        each parameter stepped as itself still where it was. Each is compared with what ``__init__`` recorded (a
        few calls a group, and one mapped over the parameters)."""
        held, address, numel = self._master
        return (master is held and master.data_ptr() == address and master.numel() == numel
                and list(state) == self._names
                and all([state[k] is t and t.data_ptr() == a and t.numel() == n for k, t, a, n in self._flat])
                and list(map(torch.Tensor.data_ptr, self._own)) == self._addresses)

    def sync(self, state: dict[str, Any]) -> None:
        """Each view's scalar states set to the group's (a step count loaded or advanced elsewhere); a tensor not
        written since the views took its value (its version counter unchanged) is not copied again."""
        for k in self.scalars:
            v = state[k]
            if isinstance(v, torch.Tensor):
                if self.versions.get(k) != v._version:
                    torch._foreach_copy_([s[k] for s in self.states], [v] * len(self.states))
                    self.versions[k] = v._version
            else:
                for s in self.states:
                    s[k] = v


def _state_piece(state: dict[str, Any], flat: dict[str, torch.Tensor], lo: int, hi: int,
                 shape: tuple[int, ...] | torch.Size) -> dict[str, Any]:
    """A view's optimizer state: each flat state's elements ``lo:hi`` in ``shape``, a copy of every other."""
    return {k: (flat[k][lo:hi].view(shape) if k in flat else v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()}


def _same(p: torch.Tensor, piece: torch.Tensor) -> bool:
    """Whether parameter ``p`` is the tensor ``piece`` is: the same memory, shape, strides, dtype and device."""
    return (p.data_ptr() == piece.data_ptr() and p.shape == piece.shape and p.stride() == piece.stride()
            and p.dtype == piece.dtype and p.device == piece.device)


def _flat_states(state: dict[str, Any], owned: int) -> dict[str, torch.Tensor]:
    """The states one element per master element (sliced per parameter); the rest (a step count) is copied."""
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() == owned and v.dim() == 1}
