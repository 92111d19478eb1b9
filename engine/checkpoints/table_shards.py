"""Sharded embedding tables in checkpoints: each rank saves its own shards, a load reshards.

Saving: each rank's file holds, under ``"tables"``, every table shard it holds (``zeroplus/embeddings``):
the fp32 rows x columns it owns and its optimizer state, keyed by the table's buffer name;
``metadata.json`` records each table's size, its optimizer's step count and every rank's rectangle (rows
``[r0, r1)``, columns ``[c0, c1)``), the collection's sharding math at the saving world size. Rank 0's
``module_extra`` leaves the shard buffers out (they differ per rank). Memory: nothing beyond the shards
(they stream from the tensors).

Loading: each rank computes its rectangle of each table now (this world size, this sharding) and copies
the overlap from every saved rectangle that intersects it, reading only those ranks' files: the same
world and sharding read one file, a different world size or sharding (table- to row-wise, 2 to 4 ranks)
reads the two or three that overlap. States follow their rows and columns (row-wise Adagrad's per-row
state follows the rows; column shards hold the same per-row values, any one is taken). Checked before
anything is written, as the rest of the load (``load.py``): a table of another size, one the checkpoint
lacks, or another optimizer type when optimizer states are loaded raise, naming the table and both values.
Memory: the overlapping pieces of other ranks' shards until the load applies them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from ..embedding_tables import collections

if TYPE_CHECKING:
    from ..accessors import EngineAccessors as Engine  # the readings of an engine it uses


def _tables(engine: Engine) -> dict[str, Any]:
    """Buffer name -> (collection, table config) for every table of the model."""
    return {f"{name}.weight__{t.name}" if name else f"weight__{t.name}": (ebc, t)
            for name, ebc in collections(engine.module).items() for t in ebc.tables}


def table_state(engine: Engine) -> dict[str, Any]:
    """This rank's shards, states and step counts (its rank file's ``"tables"``)."""
    out = {}
    for key, (ebc, t) in _tables(engine).items():
        opt = ebc.optimizers[t.name]
        weight, states = ebc.shard_values(t.name)  # (a cached table's read from its tier)
        out[key] = {"weight": weight, "state": dict(states), "step": opt.step_count,
                    "optimizer": ebc.optim_config.type}
    return out


def table_layout(engine: Engine) -> dict[str, Any]:
    """Each table's size and every rank's rectangle (``metadata.json``'s ``"tables"``)."""
    return {key: {"rows": t.num_embeddings, "dim": t.dim, "step": ebc.optimizers[t.name].step_count,
                  "shards": [[s.row0, s.row1, s.col0, s.col1] for s in ebc.shards[t.name]]}
            for key, (ebc, t) in _tables(engine).items()}


def shard_names(engine: Engine) -> set[str]:
    return set(_tables(engine))


def plan_tables(engine: Engine, meta: dict[str, Any], get: Callable[[int], dict[str, Any]], name: Callable[[int], str],
                load_optim: bool) -> list[Callable[[], None]]:
    """The copies that put every table's saved rows into this rank's shards, read and checked now; calling
    each writes."""
    saved = meta.get("tables", {})
    copies: list[Callable[[], None]] = []
    for key, (ebc, t) in _tables(engine).items():
        layout = saved.get(key)
        if layout is None:
            raise ValueError(f"checkpoint {meta.get('tag')!r} holds no embedding table {key!r} (rank "
                             f"{engine.dp.rank}); it has {sorted(saved)}")
        if (layout["rows"], layout["dim"]) != (t.num_embeddings, t.dim):
            raise ValueError(f"embedding table {key!r}: the checkpoint's is {layout['rows']} x {layout['dim']}, "
                             f"this model's {t.num_embeddings} x {t.dim}")
        mine, opt = ebc.mine(t.name), ebc.optimizers[t.name]
        if load_optim:  # every shard of a table steps alike (an empty one too): the count is the table's

            def set_step(opt: Any = opt, step: int = layout["step"]) -> None:
                opt.step_count = step
            copies.append(set_step)
        if mine.empty:
            continue
        weight, states = ebc.shard_values(t.name)
        for rank, (r0, r1, c0, c1) in enumerate(layout["shards"]):
            rows = (max(r0, mine.row0), min(r1, mine.row1))
            cols = (max(c0, mine.col0), min(c1, mine.col1))
            if rows[0] >= rows[1] or cols[0] >= cols[1]:
                continue
            entry = get(rank)["tables"][key]
            if load_optim and entry["optimizer"] != ebc.optim_config.type:
                raise ValueError(f"embedding table {key!r}: the checkpoint's optimizer states are "
                                 f"{entry['optimizer']!r} ({name(rank)}), this model's optimizer is "
                                 f"{ebc.optim_config.type!r}; load with load_optimizer_states=False")
            src = (slice(rows[0] - r0, rows[1] - r0), slice(cols[0] - c0, cols[1] - c0))
            dst = (slice(rows[0] - mine.row0, rows[1] - mine.row0), slice(cols[0] - mine.col0, cols[1] - mine.col0))
            if tuple(entry["weight"].shape) != (r1 - r0, c1 - c0):
                raise ValueError(f"embedding table {key!r}: {name(rank)} holds a {tuple(entry['weight'].shape)} shard, "
                                 f"the metadata says rows {r0}-{r1} x columns {c0}-{c1}")
            pieces: list[tuple[torch.Tensor, torch.Tensor, Any]] = [(weight, entry["weight"][src].clone(), dst)]
            if load_optim:
                for k, value in entry["state"].items():
                    per_row = value.dim() == 1
                    pieces.append((states[k], value[src[0]].clone() if per_row else value[src].clone(),
                                   dst[0] if per_row else dst))

            def write(pieces: list[tuple[torch.Tensor, torch.Tensor, Any]] = pieces) -> None:
                for target, value, where in pieces:
                    target[where].copy_(value)
            copies.append(write)

        def settle(ebc: Any = ebc, name: str = t.name, weight: torch.Tensor = weight, states: Any = states) -> None:
            ebc.replace_shard(name, weight, states)  # a cached table: the whole shard back to its tier
        copies.append(settle)
    return copies
