"""The activation techniques an engine is assembled with: what its modules do (``module_roles``, found while the
parameters are whole), resize recompute and swap attention behind one saved-tensor router, the tiles of
``zeroplus.tiled``, and the settings of ``zeroplus.checkpointing``. A technique that matches no module is refused."""
from __future__ import annotations

import logging
from typing import Any

import torch

from zeroplus import fused_ops
from zeroplus.accelerator import Accelerator
from zeroplus.activations import ResizeRecompute, SavedTensorRouter, SwapAttention, checkpointing, module_roles
from zeroplus.activations.choices import TechniqueChoice
from zeroplus.activations.lean_loss import LeanCrossEntropy
from zeroplus.activations.saved_tensors import ForwardMode
from zeroplus.activations.tiled import per_rank_tile, tile_mlps
from zeroplus.activations.tiled_loss import is_hf_causal_lm, tile_loss
from zeroplus.activations.training_cache import drop_training_cache
from zeroplus.config import ConfigError, ResolvedConfig
from zeroplus.config.blocks import TiledConfig
from zeroplus.ledger import Ledger
from zeroplus.logs import log_rank0
from zeroplus.offload.tiers import make_tier

from .model_patches import remember


def assemble_activations(model: torch.nn.Module, cfg: ResolvedConfig, ledger: Ledger, accel: Accelerator, context: int,
                         scope: list[torch.nn.Module], compiled: bool, choices: dict[str, TechniqueChoice]
                         ) -> SavedTensorRouter:
    """The activation techniques (``activation_techniques``), each reading its entry of the engine's ``choices``
    (what runs, the engine's to change: see note: frozen config). The forwards and settings the techniques change are
    given back by ``destroy``; where one of them is refused after others were made, at once, with the hooks of those
    made before it."""
    as_built = remember(model)
    claimers: list[Any] = []
    try:
        router = activation_techniques(model, cfg, ledger, accel, context, scope, compiled, choices, claimers)
    except BaseException:
        for claimer in claimers:
            claimer.remove()
        as_built()
        raise
    router.undo.append(as_built)
    return router


def activation_techniques(model: torch.nn.Module, cfg: ResolvedConfig, ledger: Ledger,
                           accel: Accelerator, context: int, scope: list[torch.nn.Module],
                           compiled: bool, choices: dict[str, TechniqueChoice],
                           claimers: list[Any]) -> SavedTensorRouter:
    """Resize recompute and swap attention (through one saved-tensor router), the tiles of
    ``zeroplus.tiled`` (``context``: ranks sharing each sequence), and the settings of
    ``zeroplus.checkpointing`` from the ``activation_checkpointing`` block. ``compiled``: the model runs compiled
    from the start (no late mode: its hook on the last block would break a whole-model graph). Each claimer is
    added to ``claimers`` as it is made (the caller takes its hooks off if a later technique is refused)."""
    zp, ac = cfg.zeroplus, cfg.activation_checkpointing
    tier = None
    if zp.swap_attention.enabled or ac.cpu_checkpointing:
        try:
            tier = make_tier(zp.activation_tier.device, zp.activation_tier.path, accel, ledger, direct=zp.direct_io)
        except ValueError as err:
            raise ConfigError(f"config key 'zeroplus.activation_tier': {err}") from None
    fused: list[str] = []
    if zp.fused_ops:
        fused, what = fused_ops.install(model, accel.name, zp.fused_ops)
        if not fused:
            raise ConfigError(f"config key 'zeroplus.fused_ops' is {zp.fused_ops!r} but {type(model).__name__} has "
                              f"no RMSNorm (a '*RMSNorm' class with weight and variance_epsilon) or gated MLP "
                              f"(gate_proj, up_proj, down_proj, a SiLU act_fn) to fuse")
        log_rank0("fused_ops: %d RMSNorms and gated MLPs run %s's %s", len(fused), accel.name, what)
    recompute = zp.resize_recompute
    if recompute.enabled:
        technique = ResizeRecompute(model, recompute.modules, recompute.names, ledger, norms=recompute.norms,
                                    functional=recompute.functional, choice=choices["resize_recompute"],
                                    fused={id(model.get_submodule(name)) for name in fused})
        claimers.append(technique)  # (its hooks come off if anything below refuses)
        kinds = ["activation functions (pointwise, keeping their input)"] if recompute.modules is None \
            else list(recompute.modules)
        _check_targets("resize_recompute", technique.targets, model,
                       kinds + (["norms (modules normalising over the last dimension)"] if recompute.norms else []),
                       recompute.names, [f.__name__ for f in technique.functions])
    swap = zp.swap_attention
    if swap.enabled:
        assert tier is not None
        swapper = SwapAttention(model, swap.modules, swap.names, tier, ledger, swap.min_bytes)
        claimers.append(swapper)
        _check_targets("swap_attention", swapper.targets, model,
                       swap.modules or ["modules that attend (a softmax over scores, an attention kernel)"], swap.names)
        if not tier.saves_memory:
            log_rank0("swap_attention: the host tier is this machine's only memory (no accelerator), so swapping "
                      "to it saves nothing; zeroplus.activation_tier {'device': 'file', 'path': DIR} swaps to files",
                      level=logging.WARNING)
    if is_hf_causal_lm(model):
        drop_training_cache(model)
    _tile(model, zp.tiled, context)
    sequence_split = cfg.zeroplus.parallel.sequence_parallel
    if ac.partition_activations and sequence_split:
        log_rank0("activation_checkpointing.partition_activations: no effect with zeroplus.parallel."
                  "sequence_parallel (checkpointed inputs are already split along the sequence)",
                  level=logging.WARNING)
    checkpointing.configure(partition_activations=ac.partition_activations and not sequence_split,
                            contiguous_checkpointing=ac.contiguous_memory_optimization,
                            num_checkpoints=ac.number_checkpoints, checkpoint_in_cpu=ac.cpu_checkpointing,
                            synchronize=ac.synchronize_checkpoint_boundary, profile=ac.profile, tier=tier,
                            ledger=ledger)
    lean: list[ForwardMode] = ([LeanCrossEntropy(choices["lean_cross_entropy"])] if zp.lean_cross_entropy is not False
                               else [])
    return SavedTensorRouter(claimers, scope=scope, around=lean, late=not compiled)


def remember_roles(model: torch.nn.Module, cfg: ResolvedConfig) -> None:
    """What the activation techniques' modules do (``module_roles.py``), found while the parameters are whole: the
    norms and activation functions always, the MLPs and the modules that attend when tiling or swap attention
    chooses them by what they compute."""
    zp = cfg.zeroplus
    module_roles.remember(model, mlps=zp.tiled.mlp_tokens is not None and zp.tiled.mlp_modules is None)
    if not zp.swap_attention.enabled or zp.swap_attention.modules is not None:
        return
    try:
        module_roles.remember_attention(model)
    except Exception as err:  # noqa: BLE001 - the model's forward on meta token ids raised
        raise ConfigError(f"config key 'zeroplus.swap_attention': its modules are found by running "
                          f"{type(model).__name__}'s forward once on token ids on the meta device, which raised "
                          f"{type(err).__name__}: {err}; name them with 'modules' (class names) or 'names' "
                          f"(qualified-name patterns)") from None


def _tile(model: torch.nn.Module, tiles: TiledConfig, context: int) -> None:
    """``zeroplus.tiled``: the MLPs and the loss run over tiles of tokens (``activations/tiled.py``). A
    tile counts tokens of the whole sequence: with the sequence split over ``context`` ranks each rank
    runs ``ceil(tokens / context)`` of its part at a time, so a tile's intermediates divide by the
    context ranks as every other activation does (a fixed per-rank tile would not)."""
    if tiles.mlp_tokens is not None:
        done = tile_mlps(model, per_rank_tile(tiles.mlp_tokens, context), tiles.mlp_modules)
        _check_targets("tiled.mlp_tokens", done, model,
                       tiles.mlp_modules or ["position-wise MLPs (two matrix products, a non-linearity between)"], [])
    if tiles.loss_tokens is not None:
        loss_tile = per_rank_tile(tiles.loss_tokens, context)
        try:
            tile_loss(model, loss_tile)
        except ValueError as err:
            raise ConfigError(f"config key 'zeroplus.tiled.loss_tokens': {err}") from None
        log_rank0("tiled.loss_tokens: the LM head and cross-entropy of %s run over %d tokens at a time%s",
                  type(model).__name__, tiles.loss_tokens,
                  f" ({loss_tile} on each of the {context} context ranks)" if context > 1 else "")


def _check_targets(key: str, targets: list[str], model: torch.nn.Module, classes: list[str], names: list[str],
                   functions: list[str] | None = None) -> None:
    """Refuse a technique that matches nothing; with ``functions`` (their calls are seen only as the forward
    runs) no module needs to match."""
    if not targets and not functions:
        raise ConfigError(f"config key 'zeroplus.{key}' matches no module of {type(model).__name__} "
                          f"(looked for: {classes}; names {names})")
    log_rank0("%s: %d modules (%s%s)%s", key, len(targets), ", ".join(targets[:3]), ", ..." if len(targets) > 3 else "",
              f", and calls of {', '.join(functions)}" if functions else "")
