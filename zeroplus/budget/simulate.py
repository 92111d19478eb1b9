"""One rank's training, simulated on the meta device: the engine's own code, no memory, no values.

The estimator builds the real engine (``engine.build.build_engine``: the same partition, hooks,
gradient reducer, stage-3 scheduler, saved-tensor router and sharded step) over a
``VirtualGroup`` of ``world_size`` ranks seen from ``rank`` and a ``MetaAccelerator`` whose
device is ``meta``, then runs ``steps`` optimizer steps of ``gradient_accumulation_steps``
micro-batches each (forward, backward, step) on meta inputs of the given shape, under a
``MemoryTracker`` (``tracker.py``) that sees every storage the engine, autograd and the model
create. Each phase's peak and who held it then is the prediction: no formula for activations,
gradient buckets or windows, only the code that will run.

What the meta device cannot show, said where it is handled:
- collectives move nothing (``VirtualGroup``): their buffers are still allocated by the engine;
- fused optimizer kernels have no meta implementation: the unfused kernel runs and its
  temporaries are not counted (``MemoryTracker.fused``), the states it creates are;
- lower memory tiers (files, pinned host) store meta tensors in a ``MetaTier`` that keeps
  nothing but answers like the real tier; the bytes on the tier are reported apart by
  ``model_states.py``;
- the gradient norm is 0 (no clipping, no overflow): memory does not depend on it.

Cost: parameters and activations take no memory; time is one step of Python and dispatch
(seconds for a 12-layer GPT) at any world size.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..accelerator import Accelerator, get_accelerator
from ..activations import checkpointing
from ..activations.module_roles import token_inputs as token_inputs_for
from ..config import ConfigError, ZeroplusConfig, auto_keys, load_config, resolve_auto, resolve_batch, resolved
from ..embeddings import EmbeddingBagCollection
from ..engine.build import build_engine, compute_dtype
from ..engine.checkpoints.async_save import stage
from ..engine.checkpoints.save import rank_state
from ..ledger import Category, Ledger
from ..meta_values import give_values, shadow_of
from ..offload import meta_tier
from ..parallel.groups import current_groups, using
from ..parallel.pipeline_schedule import train_batch
from ..parallel.plans import split_by_own_plans
from ..parallel.registry import carry_marks
from ..parallel.topology import KINDS
from ..zero.init_shards import partition_tree
from ..zero.quantized import mark_packed_copy, packed_storage
from .tracker import MemoryTracker
from .virtual_group import VirtualGroup
from .virtual_parallel import SimulatedLinks, boundary_shapes, build_in, virtual_groups


class MetaAccelerator(Accelerator):
    """The CPU accelerator's behaviour (no streams, host is device) on the meta device."""

    name = "meta"
    simulated_tier = meta_tier.MetaTier  # offload and swap tiers that count bytes and store nothing

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("meta")

    def max_memory_allocated(self) -> int:
        return 0

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """CPU's host copy is a device allocation: a meta tensor of the same size (counted, no data)."""
        return torch.empty_like(tensor.detach(), device="meta")

    def memory_allocated(self) -> int:
        return 0


def meta_copy(model: torch.nn.Module, replace: dict[int, Any] | None = None) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (the original is
    untouched and nothing is copied but the module objects). ``replace``: ``id(obj) -> stand-in`` for
    objects the copy should hold instead (process groups: themselves, or the estimate's stand-ins)."""
    memo: dict[int, Any] = dict(replace or {})
    for m in model.modules():  # sharded tables: built again on meta, never their states copied
        if isinstance(m, EmbeddingBagCollection):
            memo[id(m)] = meta_tables(m, memo.get(id(m.group)))
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        carry_marks(p, memo[id(p)])  # split over the tensor group, an expert's
        if packed_storage(p):  # a 4-bit weight: partitioned in its storage dtype (zero/quantized.py)
            mark_packed_copy(memo[id(p)])
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def meta_tables(ebc: EmbeddingBagCollection, group: Any | None) -> EmbeddingBagCollection:
    """``ebc`` built again on the meta device over ``group`` (the estimate's stand-in for its ranks; None: a
    virtual group of its own rank and size): the shards and optimizer states of that rank, no values."""
    with torch.device("meta"):
        return EmbeddingBagCollection(ebc.tables, ebc.optim_config, group or VirtualGroup(ebc.rank, ebc.world))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The engine logs its set-up; a simulation of it should not."""
    log = logging.getLogger("zeroplus")
    previous = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)


@contextlib.contextmanager
def meta_autocast_queries(device_type: str) -> Iterator[None]:
    """``torch.is_autocast_enabled("meta")`` and ``torch.get_autocast_dtype("meta")`` answer as for
    ``device_type`` (the device simulated) while the simulation runs: code that asks about autocast on
    its tensors' device (TRL's chunked log-probabilities do) raises on meta, which has no autocast.
    Only these two queries, only inside the simulation, and only for "meta"; restored on exit."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_enabled(*args: Any) -> bool:
        if args and args[0] == "meta":
            return enabled(device_type)
        return enabled(*args)

    def get_dtype(device: str) -> torch.dtype:
        return dtype(device_type if device == "meta" else device)

    torch.is_autocast_enabled, torch.get_autocast_dtype = is_enabled, get_dtype  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype  # type: ignore[assignment]


class CpuAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` on meta tensors takes the kernel CPU would take.

    The meta device has no attention backend of its own and falls back to the math path (an
    attention matrix per head, in fp32); CPU picks its fused flash kernel for most inputs, which
    saves only the output and a log-sum-exp. The choice is asked of torch with a one-element
    CPU stand-in of the same dtype and options, and the flash kernel is called on meta when CPU
    would call it. A torch-function mode is off while its handler runs, so a backward (where
    non-reentrant gradient checkpointing recomputes the forward) is run with the mode back on:
    the recompute takes the same kernel as the forward it repeats."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            q, k, v = args[:3]
            options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
            if self._flash(q, k, v, options):
                mask = options.get("attn_mask")
                if mask is not None and mask.dtype == torch.bool:  # as torch does first: -inf where False
                    mask = torch.where(mask.logical_not(), float("-inf"),
                                       torch.scalar_tensor(0.0, dtype=q.dtype, device=q.device))
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, options.get("dropout_p", 0.0), options.get("is_causal", False),
                    attn_mask=mask, scale=options.get("scale"))
                return out
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        return func(*args, **kwargs)

    def _backward(self, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """``func``'s backward run by autograd's engine with this mode on (so in force when checkpointed
        blocks are recomputed). Calling ``func`` itself with the mode on would come back here: the
        engine is reached as ``torch.autograd.backward`` reaches it (private torch calls, simulation only)."""
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        given: Any = bound.get("self", bound.get("tensors"))
        tensors = (given,) if isinstance(given, torch.Tensor) else tuple(given)
        create = bool(bound.get("create_graph", False))
        retain = bound.get("retain_graph")
        inputs = bound.get("inputs")
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        with self:
            grads = torch.autograd._tensor_or_tensors_to_tuple(bound.get("gradient", bound.get("grad_tensors")),
                                                               len(tensors))
            grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
            torch.autograd.graph._engine_run_backward(tensors, grads, create if retain is None else retain, create,
                                                      inputs, allow_unreachable=True, accumulate_grad=True)

    @staticmethod
    def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> bool:
        """Torch's own choice for CPU tensors of these head counts, head sizes, dtype, mask kind and
        options (batch and sequence 1: the choice does not depend on them); grouped-query attention
        (fewer key/value heads) included, which CPU's flash kernel takes as it is."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return False

        def stand_in(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros(1, t.shape[1], 1, t.shape[3], dtype=t.dtype)
        mask = options.get("attn_mask")
        mask = None if mask is None else torch.zeros((1,) * mask.dim(), dtype=mask.dtype)
        choice = torch._fused_sdp_choice(stand_in(q), stand_in(k), stand_in(v), mask, options.get("dropout_p", 0.0),
                                         options.get("is_causal", False), scale=options.get("scale"),
                                         enable_gqa=bool(options.get("enable_gqa", False)))
        return choice == 1  # SDPBackend.FLASH_ATTENTION


def group_stand_ins(real: Any, groups: Any) -> dict[int, Any]:
    """A module given as built holds this process's groups ``real`` (tensor-parallel layers, MoE): its
    copy holds the simulated rank's stand-ins ``groups`` instead, kind for kind, when the topologies
    agree (``meta_copy``'s ``replace``)."""
    if real is None or real.topology != groups.topology:
        return {}
    return {id(getattr(real, kind)): getattr(groups, kind) for kind in KINDS}


def _pipeline_plan(model: Any, cfg: ZeroplusConfig, groups: Any, seq_len: int | None,
                   example_inputs: tuple[Any, ...]) -> tuple[tuple[Any, Any], dict[int, Any]] | None:
    """With pipeline parallelism: one micro-batch ``(inputs, targets)`` and the shapes each chunk receives
    (``virtual_parallel.boundary_shapes``, worked out before the tracker starts counting); else None."""
    if groups.topology.pipeline == 1:
        return None
    if isinstance(model, torch.nn.Module):
        raise ValueError("a pipeline-parallel estimate needs a function that builds the model (every stage is "
                         "built to learn the shapes passed between stages), not one stage's module")
    probe = load_config(cfg)
    resolve_batch(probe, groups.data.size)
    batch = probe.train_micro_batch_size_per_gpu
    if example_inputs:
        micro = (example_inputs[0], example_inputs[1] if len(example_inputs) > 1 else None)
    elif isinstance(batch, int) and seq_len is not None:
        tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
        micro = (tokens, tokens)
    else:
        raise ConfigError(f"a pipeline-parallel estimate needs example_inputs, or seq_len ({seq_len}) and a "
                          f"micro-batch size (train_micro_batch_size_per_gpu is {batch})")
    return micro, boundary_shapes(model, groups, compute_dtype(cfg), micro[0])


def _simulate_pipeline(engine: Any, tracker: MemoryTracker, plan: tuple[tuple[Any, Any], dict[int, Any]],
                       steps: int, runtime_after_backward: int) -> None:
    """``steps`` batches through the real pipeline schedule with ``SimulatedLinks``."""
    micro, shapes = plan
    links = SimulatedLinks(engine.module, shapes)
    last = [""]

    def phase(name: str) -> None:
        if last[0] == "step":
            meta_tier.writes_landed()
        if name == "end_forward":
            tracker.end_forward()
        else:
            tracker.enter(name)
        if name == "step":
            tracker.runtime = runtime_after_backward
        last[0] = name

    for _ in range(steps):
        train_batch(engine, engine.module, iter([micro] * engine.gradient_accumulation_steps()), links, phase)
    meta_tier.writes_landed()


@contextlib.contextmanager
def _own_checkpointing_settings() -> Iterator[None]:
    """``build_engine`` configures ``zeroplus.checkpointing`` (module settings); the simulated
    engine's must not replace those of a real engine in the same process."""
    saved = copy.copy(checkpointing._settings)
    try:
        yield
    finally:
        checkpointing._settings = saved


def default_loss(out: Any) -> torch.Tensor:
    """The model's output if it is a scalar, else the sum of its first tensor (a stand-in loss)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, dict):
        out = next(iter(out.values()))
    return out if out.numel() == 1 else out.float().sum()


def _meta(value: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``value`` with every tensor replaced by a meta tensor of its shape and dtype (a tensor
    passed twice stays one tensor)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = torch.empty_like(value, device="meta")
            known = shadow_of(value) if value.device.type == "meta" else value
            if known is not None:  # small inputs (ids, masks, positions) keep their values
                give_values(memo[id(value)], known)
        return memo[id(value)]
    if isinstance(value, (tuple, list)):
        return type(value)(_meta(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v, memo) for k, v in value.items()}
    return value


def token_inputs(model: torch.nn.Module, micro_batch_size: int, seq_len: int) -> tuple[Any, ...]:
    """Inputs for a language model: token ids ``(batch, seq)``, and targets too when the model's
    forward takes them (the built-in GPT returns its loss then)."""
    return token_inputs_for(model, torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device="meta"))


CONSTRUCTIONS = ("whole", "init", "meta")


def simulate(model: torch.nn.Module | Callable[[], torch.nn.Module], config: dict[str, Any] | str | ZeroplusConfig,
             world_size: int, rank: int = 0, *, micro_batch_size: int | None = None, seq_len: int | None = None,
             example_inputs: tuple[Any, ...] | None = None, example_kwargs: dict[str, Any] | None = None,
             loss_fn: Callable[[Any], torch.Tensor] = default_loss, steps: int = 2,
             workspace: Callable[[Any, Any], int] | None = None,
             runtime: tuple[int, int] = (0, 0), routed_kernels: int = 0,
             construction: str = "whole") -> tuple[MemoryTracker, Any]:
    """Run ``steps`` optimizer steps of rank ``rank`` of ``world_size`` on the meta device;
    return the tracker (peaks per phase) and the parsed config as resolved.

    ``model``: a module (copied to the meta device) or a function building one (called on the
    meta device). Inputs: ``example_inputs`` (any tensors; only shapes and dtypes matter), or
    ``seq_len`` for token ids of ``micro_batch_size x seq_len``. ``workspace``: the CPU's kernel
    workspaces (``tracker.cpu_workspace_bytes``) when predicting for CPU, whose attention kernel
    choice is then followed too (``CpuAttention``), and so are gloo's collective temporaries
    (``VirtualGroup``); None for accelerators. ``runtime``: bytes the
    process holds beyond tensors from the engine's construction on (torch imports its compiler
    stack when the first optimizer is built), and from the end of the first backward on. ``routed_kernels``: bytes
    more from the first routing on (a ``topk`` of unknown values): what the kernel caches hold once a model whose
    product shapes change every step has filled them (``runtime_overhead.kernel_cache_bytes``).
    ``construction``: how the model reaches ``initialize``: ``"whole"`` (built normally: the init phase
    holds it whole), ``"init"`` or ``"meta"`` (``zeroplus.Init``, or the meta device given values by
    ``initialize``: each rank holds its chunk of every parameter, which ``initialize`` gathers into the
    flat buffers one parameter at a time).
    """
    _check_request(construction, seq_len, example_inputs, example_kwargs)
    cfg = _config_to_simulate(config, micro_batch_size)
    ledger = Ledger()
    tracker = MemoryTracker(ledger, workspace)
    tracker.routed_kernels = routed_kernels
    attention = CpuAttention() if workspace is not None else contextlib.nullcontext()
    memo: dict[int, torch.Tensor] = {}
    kwargs = _meta(dict(example_kwargs or {}), memo)
    groups = virtual_groups(cfg, world_size, rank, gloo_buffers=workspace is not None)  # CPU: gloo's temporaries
    pipeline = _pipeline_plan(model, cfg, groups, seq_len, _meta(tuple(example_inputs or ()), memo))
    stand_ins = group_stand_ins(current_groups(), groups)  # (this process's groups: asked before using() below)

    def make() -> torch.nn.Module:
        if isinstance(model, torch.nn.Module):
            return meta_copy(model, stand_ins)
        return build_in(groups, model)
    with _quiet(), _own_checkpointing_settings(), contextlib.ExitStack() as stack:
        stack.enter_context(using(groups))  # a model that asks for its groups at run time (context) gets these
        built = make() if construction != "whole" else None  # never whole in memory: built outside the count
        if built is not None:
            split_by_own_plans(built, groups, cfg.zeroplus.parallel.expert_capacity_factor)  # (before its chunks)
        stack.enter_context(tracker)
        stack.enter_context(attention)
        stack.enter_context(meta_autocast_queries(get_accelerator().name))
        if built is None:
            meta_model = make()  # the model as built, whole on the rank: the init phase counts it
            split_by_own_plans(meta_model, groups, cfg.zeroplus.parallel.expert_capacity_factor)  # as initialize
        else:
            meta_model = built
            partition_tree(meta_model, groups.zero, torch.device("meta"))  # Init's chunks, counted
        tracker.enter("init")
        resolve_batch(cfg, groups.data.size)
        resolve_auto(cfg, meta_model, False)
        engine = build_engine(meta_model, resolved(cfg), groups.zero, MetaAccelerator(), 0,
                              ledger=ledger, simulated=tracker, parallel=groups)
        tracker.runtime = runtime[0]
        if example_inputs is not None or kwargs or seq_len is None:  # (seq_len None: refused without them)
            inputs = _meta(tuple(example_inputs or ()), memo)
        else:
            inputs = token_inputs(meta_model, int(engine.train_micro_batch_size_per_gpu()), seq_len)
        if pipeline is not None:
            _simulate_pipeline(engine, tracker, pipeline, steps, runtime[1])
        else:
            _train(engine, tracker, lambda: loss_fn(engine(*inputs, **kwargs)), steps, runtime[1])
        tracker.category_peaks = {c.value: ledger.peak_bytes(c) for c in Category}  # training's, before the save
        _save(engine, tracker)
        engine.destroy()
    return tracker, engine.config


def _check_request(construction: str, seq_len: int | None, example_inputs: tuple[Any, ...] | None,
                   example_kwargs: dict[str, Any] | None) -> None:
    if construction not in CONSTRUCTIONS:
        raise ValueError(f"construction must be one of {CONSTRUCTIONS}, got {construction!r}")
    if seq_len is None and example_inputs is None and not example_kwargs:
        raise ValueError("give seq_len or example_inputs: activations depend on the input shape")


def _config_to_simulate(config: dict[str, Any] | str | ZeroplusConfig, micro_batch_size: int | None
                        ) -> ZeroplusConfig:
    """The config parsed (a copy the simulation may change), its micro-batch set when given; refused with
    'auto' keys, which the planner resolves."""
    cfg = load_config(config)
    if auto_keys(cfg):
        raise ConfigError(f"config keys {auto_keys(cfg)} are 'auto': zeroplus.budget.planner.plan() resolves them "
                          f"within a memory budget; estimate() predicts one config")
    if micro_batch_size is not None:
        cfg.train_micro_batch_size_per_gpu = micro_batch_size
        cfg.train_batch_size = None
    return cfg


def _train(engine: Any, tracker: MemoryTracker, loss: Callable[[], torch.Tensor], steps: int,
           runtime_after_backward: int) -> None:
    """``steps`` optimizer steps of ``gradient_accumulation_steps`` micro-batches, each phase entered in
    ``tracker``; the runtime bytes held from the end of the first backward on."""
    for _ in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            tracker.enter("forward")
            value = loss()
            tracker.end_forward()
            tracker.enter("backward")
            engine.backward(value)
            del value
            tracker.runtime = runtime_after_backward
            tracker.enter("step")
            engine.step()
            meta_tier.writes_landed()


def _save(engine: Any, tracker: MemoryTracker) -> None:
    """The ``save`` phase: what a checkpoint save holds besides the training state (its file streams; the whole
    state staged for the background writer with ``async_save``: ``async_save.py``)."""
    tracker.enter("save")
    before = tracker.live + tracker.runtime
    held_for_the_file: Any = rank_state(engine, None)
    if engine.config.zeroplus.async_save:
        held_for_the_file = stage(held_for_the_file, engine.accelerator, engine.ledger)
    tracker.observe()
    tracker.checkpoint_copies = tracker.peaks["save"].total - before
    del held_for_the_file
