"""The optimizer step over fp32 master shards: norm, overflow, clipping, then one group at a time.

1. Global gradient norm: each rank sums the squares of the gradient elements it owns (stage 0:
   the all-reduced full gradient, identical on every rank; stages 1-3: its fp32 shard, padding
   being zero), one all-reduce of one scalar at stages 1-3, then the square root, divided by the
   loss scale. Experts' groups (partitioned over the expert-data group): at stages 1-3 their shards join
   the same sum over the data group (expert-data x expert = data, so each expert counts once); at
   stage 0 their full gradients are summed over the expert group (other ranks, other experts) first.
   A non-finite norm is an overflow on every rank at once: the step is skipped. Where every gradient is whole on
   the rank (one rank, or stage 0: nothing sharded) in fp32, the norm is formed as ``clip_grad_norm_`` forms it
   instead (``_lone_root``), over the kept gradients and the flat groups' alike.
2. One coefficient per step: ``1 / (N at stage 0) / loss_scale * min(1, clip / (norm + 1e-6))``
   (torch's ``clip_grad_norm_`` rule, applied to unscaled gradients). With torch's fused Adam the step's
   kernel divides by its inverse, with no pass of its own (``kernel_scale.py``): the direct, flat, chunked
   and tiered steps alike, so each stays bit for bit the others; virtual host memory multiplies.
3. The step runs flat group by flat group: only one group's fp32 gradient exists at a time at
   stage 0 (built from the low-precision flat gradient), and the optimizer's temporaries are
   bounded by one group (none with torch's fused kernels).
Optimizer states that torch creates lazily are registered with the ledger (``optim_state``)
right after the step that creates them. How each group steps is an object chosen at assembly
(``group_steps.py``): a group whose master is split (shared-storage master weights), on a tier
(parameter offload) or whose optimizer states are offloaded steps chunk by chunk through
``chunked_step.py``; virtual host memory through its own kernel.
See note: gradient norm (docs/design-notes.md).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..collectives import Collectives, ScalarSum
from ..ledger import Category, Ledger
from ..offload.optimizer_states import TieredStates, Window, plan_sub_groups, scale_block
from ..offload.policies import OptimizerStateOffload
from ..offload.virtual_host import VirtualStates
from ..optim.muon import MatrixLayout, MatrixOptimizer, balance
from .chunked_step import ChunkedStep
from .direct_step import DirectStep, squared_norm
from .flat_group import FlatParamGroup
from .group_steps import ChunkedMasterStep, GroupStep, TieredStatesStep, VirtualStep, WholeStep
from .kernel_scale import divided_in_kernel, free_for_scalars, scalars_in_kernel, scales_in_kernel, takes_device_scalars
from .partition import ZeroPartition

_NORM_CHUNK = 1 << 20  # elements per float64 temporary (8 MiB at most; the longest owned gradient if shorter)


@runtime_checkable
class SegmentedOptimizer(Protocol):
    """An optimizer that needs each flat shard's per-parameter pieces (``optim/lamb.py``: the trust ratio is per
    parameter, so it sums the squares of each piece over the data group); told them once, at construction."""

    def set_segments(self, param: torch.Tensor, segments: list[tuple[int, int, int]], num_params: int,
                     dp: ScalarSum) -> None: ...


def _buffers(ledger: Ledger, device: torch.device) -> Callable[[int], torch.Tensor]:
    """fp32 buffers of a given size on ``device``, counted as ``comm_buffer`` (Muon's gathered matrices)."""
    def make(numel: int) -> torch.Tensor:
        return ledger.empty(numel, torch.float32, Category.COMM_BUFFER, device)
    return make


class _LocalGroup:
    """Stands in for a data-parallel group where nothing needs summing (stage 0 owns everything)."""

    size = 1

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        return value


def _norm_dtype(device: torch.device) -> torch.dtype:
    """float64, so the sum hardly depends on how the gradient is sharded; NPUs lack it: float32."""
    return torch.float32 if device.type == "npu" else torch.float64


def _sum_of_squares(t: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Sum of ``t``'s squares in ``scratch``'s dtype, ``_NORM_CHUNK`` elements at a time through
    ``scratch`` (one buffer for the whole norm: a new 8 MiB temporary per chunk cost as much as the
    arithmetic, 0.1 s against 0.05 s for 110M elements here)."""
    total = torch.zeros((), dtype=scratch.dtype, device=t.device)
    for a in range(0, t.numel(), _NORM_CHUNK):
        piece = t[a:a + _NORM_CHUNK]
        chunk = scratch[:piece.numel()].copy_(piece)
        total += torch.dot(chunk, chunk)
    return total


class ModelParallelNorm:
    """The gradient norm over a model split across tensor and pipeline ranks: each rank sums its own
    parameters' squares, a parameter whole on all ``T`` tensor ranks (norms, row-parallel biases) at
    weight ``1/T``, and the sum runs over the model-parallel group (tensor x pipeline) after the data
    group, so every parameter counts once."""

    def __init__(self, group: Collectives, tensor_size: int, is_split: Any) -> None:
        self.group, self.tensor_size, self.is_split = group, tensor_size, is_split

    def weight(self, param: torch.Tensor) -> float:
        return 1.0 if self.tensor_size == 1 or self.is_split(param) else 1.0 / self.tensor_size

    def has_replicated(self, g: FlatParamGroup) -> bool:
        return self.tensor_size > 1 and not all(self.is_split(p) for p in g.params)


@dataclass(frozen=True)
class StepPolicy:
    """How the step runs beyond the partition and the optimizer.

    ``gradient_clipping``: the global norm's bound (0: none). ``master_chunk_numel``: elements per
    chunk when the master is read and rewritten (shared or tiered masters; one fp32 work buffer of
    this length). ``offload``: the tier and window keeping optimizer states on a lower tier, or None.
    ``virtual_kernels``: the NPU's swapped-memory allocator and AdamW kernel
    (``offload/virtual_host.py``) keeping the states in mapped host memory, or None.
    ``model_parallel``: how the norm counts parameters split over (or replicated on) the tensor and
    pipeline ranks; None without model parallelism. ``expert_group``: the expert-parallel group when
    experts are split over ranks (the stage-0 norm sums over it). ``replicas``: under MiCS, the ranks holding this
    rank's shards alike (one of each shard group), over which the reduced gradient shards are averaged before
    anything reads them; None otherwise. ``scalars_on_device``: the loss scale never
    changes with an overflow (bf16, fp32, a static fp16 scale), so nothing on the host needs the step's
    overflow at once: where the optimizer's kernel takes them, the clip coefficient and the overflow flag stay
    device tensors (see note: no host sync)."""

    gradient_clipping: float = 0.0
    master_chunk_numel: int = 1 << 20
    offload: OptimizerStateOffload | None = None
    virtual_kernels: Any = None
    model_parallel: ModelParallelNorm | None = None
    expert_group: Collectives | None = None
    replicas: Collectives | None = None
    scalars_on_device: bool = False


class StepOutcome:
    """Whether a step changed the weights: known on the host (``applied``), or the kernel's overflow flag left on
    the device (``found_inf``: 1.0 where the kernel skipped the update), read only when someone asks."""

    def __init__(self, applied: bool | None, found_inf: torch.Tensor | None = None) -> None:
        self._applied, self.found_inf = applied, found_inf

    @property
    def on_host(self) -> bool:
        return self.found_inf is None

    def applied(self) -> bool:
        if self._applied is None:
            assert self.found_inf is not None
            self._applied = not bool(self.found_inf.item())  # (a read from the device: asked for)
        return self._applied


class ShardedStep:
    def __init__(self, partition: ZeroPartition, optimizer: torch.optim.Optimizer, dp: Collectives,
                 ledger: Ledger, policy: StepPolicy = StepPolicy()) -> None:
        self.partition = partition
        self.optimizer = optimizer
        self.clip = float(policy.gradient_clipping)
        self.dp = dp
        self.ledger = ledger
        self.model_parallel = policy.model_parallel
        self.expert_group = policy.expert_group
        self.replicas = policy.replicas
        # every gradient whole on this rank, nothing split over other ranks (decided here): one rank, or stage 0 at any
        # world size (each rank holds the whole all-reduced gradient, the same values on every rank); the norm may
        # then be the plain module's (_lone_root)
        self._alone = ((dp.size == 1 or not partition.stage.partitions) and self.replicas is None
                       and self.model_parallel is None and self.expert_group is None)
        # there, the groups' parameters in the model's (the root unit's module) order, as a plain clip_grad_norm_ over
        # model.parameters() stacks their norms: the stacked norms' sum depends on it (its vector width)
        self._lone_order: list[int] = []
        if self._alone:
            place = {id(p): i for i, p in enumerate(partition.root.module.parameters())}
            params = [p for g in partition.groups for p in g.params]
            self._lone_order = sorted(range(len(params)), key=lambda i: place.get(id(params[i]), i))
        # the last step's norm; until read, (the device's root of the sum of squares, what it is divided by)
        self._norm: float | tuple[torch.Tensor, float] | None = None
        offload, virtual_kernels = policy.offload, policy.virtual_kernels
        self._options = {id(p): pg for pg in optimizer.param_groups for p in pg["params"]}
        # how each group steps, decided once (group_steps.py): by where its master and optimizer states live
        self.steps: dict[int, GroupStep] = {}
        chunked = ChunkedStep(optimizer, ledger, policy.master_chunk_numel)
        tiered: list[TieredStates] = []
        if virtual_kernels is not None:
            for g in partition.groups:
                self.steps[id(g)] = VirtualStep(VirtualStates(g.owned_numel, g.device, ledger, virtual_kernels),
                                                self._options[id(g.master_param)])
        elif offload is not None:
            plan = plan_sub_groups([g.owned_numel for g in partition.groups], offload.sub_group_size, offload.ratio,
                                   scale_block(optimizer))
            window = Window(offload.buffer_count)
            for g, (chunks, resident) in zip(partition.groups, plan):
                tiered.append(TieredStates(offload.tier, chunks, resident, window, ledger))
                self.steps[id(g)] = TieredStatesStep(chunked, tiered[-1])
        for g in partition.groups:
            if id(g) not in self.steps:
                store = g.master_store
                self.steps[id(g)] = (ChunkedMasterStep(optimizer, ledger, chunked) if store.copied
                                     else WholeStep(optimizer, ledger))
        self.first_tiered = tiered[0] if tiered else None  # its first reads overlap the norm's all-reduce
        # one rank: autograd's gradients as they are (a parameter over the chunk stepped in pieces where not fused)
        self.direct = DirectStep(optimizer, self._options, ledger, policy.master_chunk_numel)
        self.direct.enabled &= offload is None and virtual_kernels is None
        self.direct.declare_segments(partition.groups)
        if isinstance(optimizer, SegmentedOptimizer):  # a capability (Lamb's per-parameter trust ratio), not a class
            for g in partition.groups:
                optimizer.set_segments(g.master_param, g.param_segments(), len(g.params),
                                       g.dp if partition.stage.partitions else _LocalGroup())
        if isinstance(optimizer, MatrixOptimizer):  # Muon: each shard's matrices, made whole at its step
            self._declare_matrices(optimizer, partition, ledger)
        # decided once: every group steps through a kernel that takes the scalars (virtual host memory's does not)
        self.on_device = (policy.scalars_on_device and takes_device_scalars(optimizer)
                          and not any(step.own_kernel for step in self.steps.values()))

    def _declare_matrices(self, optimizer: MatrixOptimizer, partition: ZeroPartition, ledger: Ledger) -> None:
        """Where each Muon group's matrices lie and which rank orthogonalizes each (``muon.balance``); refused where
        a Muon group's master is not stepped whole."""
        layouts = []
        for g in partition.groups:
            if not optimizer.takes_matrices(g.master_param):
                continue
            if type(self.steps[id(g)]) is not WholeStep:
                raise ValueError(f"{g.name}: Muon steps a resident fp32 master whole, and this group's is stepped "
                                 f"{type(self.steps[id(g)]).__name__} (offloaded, split or virtual)")
            layouts.append((g, MatrixLayout(
                list(g.shapes), list(g.offsets), g.padded_numel, g.param_segments(),
                g.dp if partition.stage.partitions and g.dp.size > 1 else None, _buffers(ledger, g.device))))
        balance([layout for _, layout in layouts])
        for g, layout in layouts:
            optimizer.set_matrices(g.master_param, layout)

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm (unscaled, before clipping; inf on overflow), read from the device
        the first time it is asked for."""
        if isinstance(self._norm, tuple):
            root, divisor = self._norm
            value = root.item()  # (a read from the device: asked for)
            self._norm = value / divisor if math.isfinite(value) else float("inf")
        return self._norm

    def _direct_grads(self) -> dict[int, list[torch.Tensor]]:
        """The groups stepped over their kept gradients (``direct_step.py``), by id; every other group's kept
        gradients are moved into its flat buffer here, before anything reads them."""
        out = {}
        mp = self.model_parallel
        for g in self.partition.groups:
            if mp is not None and mp.has_replicated(g):  # the norm weighs its parameters: the flat path's segments
                g.gradient.settle_kept()
                continue
            grads = self.direct.grads(g)
            if grads is not None:
                out[id(g)] = grads
        return out

    def _average_over_replicas(self) -> None:
        """MiCS: each trained group's reduced gradient shard (the mean over its shard group: ``grad_reducer.py``
        divides by the group's size) summed over the replicas holding the same shard, one all-reduce a group, all in
        flight at once, and divided by their number: every replica then holds the mean over every data rank, as flat
        ZeRO's shard does (in another order of additions), and steps alike. Experts' groups, partitioned over their
        expert-data group and divided by D already (``grad_reducer.py``), are not replicated: left as they are."""
        assert self.replicas is not None
        shards = [g.gradient.ensure_reduced() for g in self.partition.groups if g.dp is self.partition.dp]
        handles = [self.replicas.all_reduce(shard) for shard in shards]
        for handle, shard in zip(handles, shards):
            handle.wait()
            shard.div_(self.replicas.size)

    def _squares(self, direct: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """The sum of the squares of every gradient element, over every rank (a 0-d device tensor)."""
        stage0 = not self.partition.stage.partitions
        device = self.partition.groups[0].device if self.partition.groups else torch.device("cpu")
        dtype = _norm_dtype(device)
        kept = [t for grads in direct.values() for t in grads]  # (one norm call for them all)
        total = squared_norm(kept, dtype) if kept else torch.zeros((), dtype=dtype, device=device)
        flat = [g for g in self.partition.groups if id(g) not in direct]
        longest = max((g.owned_numel for g in flat), default=1)
        scratch = torch.empty(min(_NORM_CHUNK, longest) if flat else 0, dtype=dtype, device=device)  # <= a source
        # stage 0: the experts' part, summed over the expert group (no kernel where no group holds experts); under
        # MiCS, summed over the shard group and then the replicas (each expert shard is on one rank of them all), where
        # the rest is summed over the shard group only (each of its shards is on every replica)
        apart = (stage0 or self.replicas is not None) and any(g.expert for g in flat)
        experts = torch.zeros_like(total) if apart else total
        mp = self.model_parallel
        for g in flat:
            source = g.step_gradient()
            into = experts if apart and g.expert else total
            if mp is None or not mp.has_replicated(g):
                into += _sum_of_squares(source, scratch)
                continue
            segments = ([(i, o, o + n) for i, (o, n) in enumerate(zip(g.offsets, g.numels))] if stage0
                        else g.param_segments())
            for i, a, b in segments:  # a parameter whole on every tensor rank counts 1/T on each
                into += _sum_of_squares(source[a:b], scratch) * mp.weight(g.params[i])
        if experts is not total and stage0 and self.expert_group is not None:
            total += self.expert_group.sum_scalar(experts)
        if not stage0:
            self.dp.sum_scalar(total)
        if experts is not total and not stage0 and self.replicas is not None:
            total += self.replicas.sum_scalar(self.dp.sum_scalar(experts))
        if mp is not None:
            mp.group.sum_scalar(total)
        return total

    def _lone_root(self, direct: dict[int, list[torch.Tensor]]) -> torch.Tensor | None:
        """Every gradient whole on this rank (one rank; stage 0 at any world size, where each rank holds the same
        all-reduced sum and so forms the same norm with no collective), nothing split over other ranks, fp32
        gradients: the global norm as the plain module's ``clip_grad_norm_`` forms it (one fp32 norm per gradient,
        in ``model.parameters()``'s order, then the norm of those: three kernels, where the squares summed in
        float64 through a buffer take three per 2^20 elements and a copy of every gradient element), over the kept
        gradients and over views of the flat groups' (a parameter without a gradient counts as its zeros there).
        None elsewhere: the squares are summed over shards and ranks (``_squares``), in float64 so the sum hardly
        depends on the sharding."""
        if not self._alone:
            return None
        grads: list[torch.Tensor] = []
        for g in self.partition.groups:
            kept = direct.get(id(g))
            if kept is None:  # a flat group (stage 0 on ranks, an optimizer that is not elementwise): its views
                kept = g.step_gradient_views()
                if kept[0].dtype != torch.float32:
                    return None
            grads.extend(kept)
        if not grads:
            return None
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([grads[i] for i in self._lone_order])))

    def _host_norm(self, root: torch.Tensor, loss_scale: float) -> float:
        """The norm read on the host from ``root``, the root of the sum of squares."""
        if root.device.type == "meta":  # the estimator's simulated step: no values, clipping is free
            return 0.0
        value = root.item()  # (one read from the device: a synchronisation)
        norm = value if math.isfinite(value) else float("inf")
        if not self.partition.stage.partitions:
            norm /= self.dp.size
        return norm / loss_scale

    def _master_grad(self, g: FlatParamGroup, coef: float) -> torch.Tensor:
        grad = g.step_gradient()
        if grad.dtype != torch.float32:  # low precision: this group's fp32 gradient only, for its step
            grad = self.ledger.empty(grad.numel(), torch.float32, Category.GRAD, grad.device).copy_(grad)
        return grad.mul_(coef) if coef != 1.0 else grad

    def step(self, loss_scale: float) -> StepOutcome:
        """Step every flat group. Where the scalars stay on the device (``on_device``) the kernel skips the update
        on an overflow and the outcome holds its flag; else the norm is read here and an overflow changes
        nothing (``applied()`` False)."""
        first = self.first_tiered
        if first is not None:  # offloaded states: the first reads overlap the norm's all-reduce
            first.window.ahead(first, -1, first.window.size)
        if self.replicas is not None:
            self._average_over_replicas()
        direct = self._direct_grads()
        root = self._lone_root(direct)
        if root is None:
            root = self._squares(direct).sqrt()  # (float64: correctly rounded, as math.sqrt)
        if self.on_device and root.device.type != "meta" and free_for_scalars(self.optimizer):
            return self._step_on_device(root, loss_scale, direct)
        norm = self._host_norm(root, loss_scale)
        self._norm = norm
        if not math.isfinite(norm):
            return StepOutcome(False)
        coef = 1.0 / loss_scale
        if not self.partition.stage.partitions:
            coef /= self.dp.size
        if self.clip > 0:
            coef *= min(1.0, self.clip / (norm + 1e-6))
        self.direct.step([(g, direct[id(g)]) for g in self.partition.groups if id(g) in direct], coef)
        rest = [g for g in self.partition.groups if id(g) not in direct]
        in_kernel = bool(rest) and scales_in_kernel(self.optimizer, coef)  # the flat, chunked and tiered steps alike
        with divided_in_kernel(self.optimizer, coef, rest[0].device) if in_kernel else nullcontext():
            for g in rest:
                self._step_group(g, coef, 1.0 if in_kernel else coef)
        return StepOutcome(True)

    def _step_on_device(self, root: torch.Tensor, loss_scale: float,
                        direct: dict[int, list[torch.Tensor]]) -> StepOutcome:
        """The step with its scalars as device tensors, in as few kernels as the arithmetic allows (each is a launch
        on a GPU): ``grad_scale = max(1, (norm + 1e-6) / clip) / base``, the host path's ``1 / coef`` where the clip
        does not bind and within an fp32 ulp where it does; ``found_inf`` 1.0 where ``root`` (the root of the sum of
        squares) is not finite (a value is finite exactly when zero times it is zero). The norm itself is worked out
        when it is read. No value is read on the host (see note: no host sync)."""
        divisor = loss_scale * (1 if self.partition.stage.partitions else self.dp.size)  # norm = root / it
        self._norm = (root, divisor)
        if self.clip > 0:
            # (``root`` is kept for the norm: the first op makes a new tensor)
            ratio = ((root / divisor).add_(1e-6) if divisor != 1 else root + 1e-6).div_(self.clip).clamp_(min=1.0)
            grad_scale = (ratio if divisor == 1 else ratio.mul_(divisor)).to(torch.float32)
        else:
            grad_scale = torch.full((), divisor, dtype=torch.float32, device=root.device)
        # 0 * root is 0 where it is finite and NaN where it is inf or NaN: two kernels, written as fp32
        found_inf = torch.ne(root * 0, 0, out=torch.empty((), dtype=torch.float32, device=root.device))
        with scalars_in_kernel(self.optimizer, grad_scale, found_inf):
            self.direct.step([(g, direct[id(g)]) for g in self.partition.groups if id(g) in direct], None)
            for g in self.partition.groups:
                if id(g) not in direct:
                    self._step_group(g, 1.0, 1.0)
        return StepOutcome(None, found_inf)

    def _step_group(self, g: FlatParamGroup, coef: float, multiply: float) -> None:
        """One flat group's step: its gradient multiplied by ``multiply`` first (1 where the optimizer's fused kernel
        divides by ``1 / coef`` itself), or by ``coef`` where the group's kernel is not torch's (virtual host
        memory)."""
        step = self.steps[id(g)]
        step.step(g, self._master_grad(g, coef if step.own_kernel else multiply))

    def state_of(self, g: FlatParamGroup) -> dict[str, Any]:
        """The optimizer state of ``g``'s owned range, full size (read from the tier if offloaded)."""
        return self.steps[id(g)].state(g)

    def load_state(self, g: FlatParamGroup, state: dict[str, Any]) -> None:
        self.direct.forget(g)  # (its views would hold the replaced states until the next step)
        self.steps[id(g)].load(g, state)
