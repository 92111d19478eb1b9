"""The engine's side of sharded embedding tables (``zeroplus/embeddings``): found in the model, checked,
counted in the ledger and stepped with the dense part.

A model holding ``EmbeddingBagCollection`` modules trains through ``initialize`` as any other: the tables
are buffers (never flattened, gathered or reduced by ZeRO), their row gradients wait sparse in the
collection, and ``engine.step()`` at the accumulation boundary applies them right after the dense
optimizer step, or drops them when the step is skipped. The loss the engine back-propagates is already
divided by the accumulation steps, so the table gradients are too. Ledger: each shard under ``param`` and
its optimizer state under ``optim_state``, the bytes ``tables.shard_bytes`` and ``sparse_optim.state_bytes``
state, per rank; a table cached from a tier (``row_cache.py``) counts its slots there instead, and its row map
under ``param``.

Refused (``ConfigError``, every rank alike, before anything is built): a collection over another group than
the engine's data-parallel ranks; fp16 (the pending gradients are not unscaled or checked for overflow);
``gradient_clipping`` (the tables' gradients are not in the global norm); tensor, pipeline, context or
expert parallelism beside them.
"""
from __future__ import annotations

import torch

from zeroplus.collectives import Collectives
from zeroplus.config import ConfigError, ResolvedConfig
from zeroplus.embeddings import EmbeddingBagCollection
from zeroplus.ledger import Category, Ledger
from zeroplus.parallel.groups import ParallelGroups
from zeroplus.zero import StepOutcome


def collections(model: torch.nn.Module) -> dict[str, EmbeddingBagCollection]:
    """The model's embedding collections by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}


def table_buffer_names(model: torch.nn.Module) -> set[str]:
    """The buffers that are table shards (they differ between ranks by design)."""
    return {f"{name}.{b}" if name else b for name, m in collections(model).items()
            for b, _ in m.named_buffers(recurse=False)}


def check_tables(model: torch.nn.Module, cfg: ResolvedConfig, dp: Collectives,
                 parallel: ParallelGroups | None) -> None:
    found = collections(model)
    if not found:
        return
    where = f"{type(model).__name__} holds sharded embedding tables ({', '.join(n or '<root>' for n in found)})"
    for name, ebc in found.items():
        if ebc.world != dp.size or ebc.rank != dp.rank:
            raise ConfigError(f"{where}: '{name}' is sharded over {ebc.world} ranks (this rank {ebc.rank}), the "
                              f"engine's data-parallel group has {dp.size} (this rank {dp.rank}); build the "
                              f"collection over the same ranks (group=None after init_process_group)")
    if cfg.fp16.enabled is True:
        raise ConfigError(f"{where}, and the config enables fp16: the tables' sparse gradients are not unscaled or "
                          f"checked for overflow yet; use bf16 or fp32")
    if cfg.gradient_clipping:
        raise ConfigError(f"{where}, and config key 'gradient_clipping' is {cfg.gradient_clipping}: the tables' "
                          f"gradients are not in the global norm yet; set it to 0")
    if parallel is not None and (parallel.model.size > 1 or parallel.expert.size > 1
                                 or parallel.topology.context > 1):
        raise ConfigError(f"{where}, beside {parallel.topology.describe()}: tables shard over data-parallel ranks "
                          f"only")


class EmbeddingTables:
    """What the engine does with the model's collections: ledger entries, the step, and drops."""

    def __init__(self, model: torch.nn.Module, ledger: Ledger) -> None:
        self.collections = list(collections(model).values())
        for ebc in self.collections:
            for t in ebc.tables:
                ledger.track(ebc.weight(t.name), Category.PARAM)  # a cached table's: its slots
                for state in ebc.optimizers[t.name].state.values():
                    ledger.track(state, Category.OPTIM_STATE)
            for cache in ebc.caches.values():  # the row -> slot map, 8 bytes per shard row
                ledger.track(cache.slot_of, Category.PARAM)

    def step(self, outcome: StepOutcome) -> None:
        """The accumulation boundary: the pending row gradients applied (the dense step ran), or dropped with
        the skipped step (read from the outcome only where there are tables)."""
        for ebc in self.collections:
            if outcome.applied():
                ebc.step()
            else:
                ebc.drop_pending()
