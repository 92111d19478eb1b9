"""Activation checkpointing, DeepSpeed's API: ``zeroplus.checkpointing.checkpoint(fn, *args)`` (this module
lives with the other activation techniques; ``zeroplus.checkpointing`` is its public name, as in DeepSpeed;
training checkpoints are ``engine/checkpoints/``).

``checkpoint`` runs ``fn`` without keeping its intermediate activations: only its tensor inputs
are saved, and in backward ``fn`` runs again (with the random-number state it had in forward, so
dropout matches) and its gradients flow back. Memory: the inputs of every checkpointed call, plus
one call's activations at a time in backward; compute: one extra forward of ``fn``.

The engine configures it from the ``activation_checkpointing`` block (``configure`` does the same
by hand, with DeepSpeed's keyword names):

- ``cpu_checkpointing`` (``checkpoint_in_cpu``): the saved inputs move to the activation tier
  (``zeroplus.activation_tier``: host memory on an accelerator; on a CPU-only machine host
  memory is the same memory, so use the ``file`` tier there to save anything) and come back in
  backward; the ledger shows the moved bytes as ``cpu_checkpointing`` / ``activation`` not held.
- ``synchronize_checkpoint_boundary`` (``synchronize``): the device is synchronised before and
  after each checkpointed forward and replay.
- ``profile``: each checkpointed forward and replay logs its time.
- ``number_checkpoints`` and ``contiguous_memory_optimization`` only size DeepSpeed's contiguous
  activation buffers, which zeroplus does not use: warned about, no effect.
- ``partition_activations``: each rank of the tensor-parallel group (``zeroplus.parallel``) keeps
  1/T of every saved input (the inputs are the same on all of them), and backward all-gathers them
  before the replay; the ledger shows the bytes not kept as ``partition_activations`` /
  ``activation``. Memory: ``1/T`` of the saved inputs (rounded up to whole elements per rank);
  communication: one all-gather per saved input per backward. Without a tensor group: warned.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch

from ..accelerator import get_accelerator
from ..ledger import Category, Ledger
from ..offload.tiers import HostTier, Tier
from ..parallel.groups import parallel_groups
from ..parallel.mappings import all_gather_dim0

logger = logging.getLogger("zeroplus.checkpointing")
TECHNIQUE = "cpu_checkpointing"  # ledger: checkpointed inputs moved off the device, not held
PARTITION = "partition_activations"  # ledger: the other tensor ranks' parts of checkpointed inputs, not held


@dataclasses.dataclass
class _Settings:
    configured: bool = False
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    tier: Tier | None = None
    partition: Any = None  # the tensor-parallel group when partition_activations is on
    ledger: Any = None


_settings = _Settings()


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None, profile: bool | None = None,
              tier: Tier | None = None, ledger: Any = None) -> None:
    """Set how ``checkpoint`` behaves (the engine calls this from the config)."""
    ignored = []
    partition = None
    if partition_activations:
        partition = parallel_groups().tensor
        if partition.size == 1:
            ignored.append("partition_activations (needs a tensor-parallel group: zeroplus.parallel.tensor > 1)")
            partition = None
    if contiguous_checkpointing or num_checkpoints:
        ignored.append("contiguous_memory_optimization / number_checkpoints (size DeepSpeed's contiguous "
                       "activation buffers, which zeroplus does not use)")
    if mpu_ is not None:
        ignored.append("mpu_ (zeroplus's own tensor group is used: zeroplus.init_parallel)")
    if ignored:
        logger.warning("activation checkpointing: without effect: %s", "; ".join(ignored))
    if checkpoint_in_cpu and tier is None:
        tier = HostTier(get_accelerator(), Ledger())
    if checkpoint_in_cpu and tier is not None and not tier.saves_memory:
        logger.warning("activation checkpointing: cpu_checkpointing moves inputs to host memory, which on this "
                       "machine is the device's memory: nothing is saved (zeroplus.activation_tier "
                       "{'device': 'file'} keeps them in files)")
    _settings.configured = True
    _settings.cpu_checkpointing = bool(checkpoint_in_cpu)
    _settings.synchronize = bool(synchronize)
    _settings.profile = bool(profile)
    _settings.tier = tier if checkpoint_in_cpu else None
    _settings.partition = partition
    _settings.ledger = ledger if ledger is not None else (tier.ledger if tier is not None else None)


def is_configured() -> bool:
    return _settings.configured


def reset() -> None:
    """Forget the configuration (DeepSpeed's ``reset`` frees its buffers; there are none here)."""
    global _settings
    _settings = _Settings()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, keeping only its inputs for backward. Returns what ``function`` returns
    (tensors, or a tuple with tensors)."""
    return _CheckpointFunction.apply(function, _settings, *args)


def _device_rng_states(args: tuple) -> tuple[torch.device, Any] | None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type in ("cuda", "npu"):
            module = getattr(torch, a.device.type)
            return a.device, module.get_rng_state(a.device)
    return None


class _Timed:
    def __init__(self, settings: _Settings, what: str) -> None:
        self.settings, self.what = settings, what

    def __enter__(self) -> None:
        if self.settings.synchronize:
            get_accelerator().synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        if self.settings.synchronize:
            get_accelerator().synchronize()
        if self.settings.profile:
            logger.info("activation checkpoint %s: %.2f ms", self.what, 1e3 * (time.perf_counter() - self.start))


def _keep_own_part(tensors: list[torch.Tensor], tp: Any) -> tuple[list[torch.Tensor], int]:
    """This tensor rank's ``ceil(n / T)`` elements of each (flattened, zero-padded), and the bytes not kept."""
    parts, dropped = [], 0
    for t in tensors:
        per = -(-t.numel() // tp.size)
        flat = t.reshape(-1)
        part = torch.zeros(per, dtype=t.dtype, device=t.device)
        a, b = min(tp.rank * per, flat.numel()), min((tp.rank + 1) * per, flat.numel())
        part[:b - a].copy_(flat[a:b])
        parts.append(part)
        dropped += (t.numel() - per) * t.element_size()
    return parts, dropped


def _gather_parts(parts: list[torch.Tensor], shapes: list[torch.Size], tp: Any) -> list[torch.Tensor]:
    return [all_gather_dim0(p, tp)[:shape.numel()].view(shape) for p, shape in zip(parts, shapes)]


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: Callable[..., Any], settings: _Settings, *args: Any) -> Any:
        ctx.function, ctx.settings = function, settings
        ctx.rng = torch.get_rng_state()
        ctx.device_rng = _device_rng_states(args)
        ctx.grad_mask = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        ctx.layout = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [a.detach() for a in args if isinstance(a, torch.Tensor)]
        ctx.shapes = None
        if settings.partition is not None:
            ctx.shapes = [t.shape for t in tensors]
            tensors, ctx.partitioned = _keep_own_part(tensors, settings.partition)
            if settings.ledger is not None:
                settings.ledger.save(PARTITION, Category.ACTIVATION, ctx.partitioned)
        if settings.tier is not None:
            ctx.stored = [settings.tier.put(t) for t in tensors]
            ctx.moved = sum(t.numel() * t.element_size() for t in tensors) if settings.tier.saves_memory else 0
            settings.tier.ledger.save(TECHNIQUE, Category.ACTIVATION, ctx.moved)
        else:
            ctx.save_for_backward(*tensors)
        with torch.no_grad(), _Timed(settings, "forward"):
            return function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        settings = ctx.settings
        if settings.tier is not None:
            tensors = [settings.tier.get(s) for s in ctx.stored]
            ctx.stored = None
            settings.tier.ledger.unsave(TECHNIQUE, Category.ACTIVATION, ctx.moved)
        else:
            tensors = list(ctx.saved_tensors)
        if ctx.shapes is not None:
            tensors = _gather_parts(tensors, ctx.shapes, settings.partition)
            if settings.ledger is not None:
                settings.ledger.unsave(PARTITION, Category.ACTIVATION, ctx.partitioned)
        inputs, it = [], iter(tensors)
        for is_tensor, other, needs_grad in zip(ctx.layout, ctx.others, ctx.grad_mask):
            inputs.append(next(it).detach().requires_grad_(needs_grad) if is_tensor else other)
        devices = [ctx.device_rng[0]] if ctx.device_rng else []
        with torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda"):
            torch.set_rng_state(ctx.rng)
            if ctx.device_rng:
                getattr(torch, devices[0].type).set_rng_state(ctx.device_rng[1], devices[0])
            with torch.enable_grad(), _Timed(settings, "replay"):
                outputs = ctx.function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(i.grad if isinstance(i, torch.Tensor) and i.requires_grad else None
                                    for i in inputs)
