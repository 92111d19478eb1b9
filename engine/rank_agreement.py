"""At ``initialize``, before anything is allocated or broadcast: do the ranks agree?

Ranks given different configs (ZeRO stage, accumulation steps, parallel sizes) or different models
issue different collectives and hang; models with differently sized tensors are silently filled by
the initial broadcast. So every rank of the data group hashes what must agree (the resolved config,
every parameter's and buffer's name, shape, dtype and trainability, the topology) and the ranks
exchange the 32-byte digests: one small all-gather when all agree. When they do not, they exchange the
descriptions themselves and every rank raises the same ``ConfigError`` naming the first difference
and the ranks that differ.

``zeroplus.memory_budget`` must be set on every rank or on none, but its value may differ: a budget made per rank
(from ``zeroplus.estimate``, or a machine's memory) differs between ranks by the bytes each process measured, and
heterogeneous hosts differ by more. Every rank then trains in the smallest (``agree_on_budget``), which holds on
each rank; the ranks' values are logged, as a warning where they differ by over 1%. See note: budget per rank
(docs/design-notes.md).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
from typing import Any

import torch

from zeroplus.collectives import Collectives
from zeroplus.config import ConfigError, ZeroplusConfig, parse_bytes
from zeroplus.logs import log_rank0

from .embedding_tables import table_buffer_names

# Keys that may differ between ranks without changing what they communicate (paths are often per rank).
_PER_RANK_KEYS = ("zeroplus.log_level", "zeroplus.activation_tier.path",
                  "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path")


def describe_rank(model: torch.nn.Module, cfg: ZeroplusConfig, topology: dict[str, int]) -> dict[str, Any]:
    shards = table_buffer_names(model)  # sharded embedding tables differ between ranks by design
    config = cfg.model_dump(mode="json")
    for key in _PER_RANK_KEYS:
        *blocks, leaf = key.split(".")
        holder: Any = config
        for block in blocks:
            holder = holder.get(block) if isinstance(holder, dict) else None
        if isinstance(holder, dict):
            holder.pop(leaf, None)
    ours = config.get("zeroplus")
    if isinstance(ours, dict) and ours.get("memory_budget") is not None:
        ours["memory_budget"] = "set"  # its value may differ (agree_on_budget)
    return {"config": config, "topology": topology,
            "parameters": [[n, list(p.shape), str(p.dtype).replace("torch.", ""), p.requires_grad]
                           for n, p in model.named_parameters()],
            "buffers": [[n, list(b.shape), str(b.dtype).replace("torch.", "")] for n, b in model.named_buffers()
                        if n not in shards]}


def _digest(description: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The first place where ``a`` and ``b`` differ, as ``path: A vs B``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                left, right = (repr(d[key]) if key in d else "missing" for d in (a, b))
                return f"{path}{key}: {left} vs {right}"
            found = _first_difference(a[key], b[key], f"{path}{key}.")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and path in ("parameters.", "buffers."):
        for x, y in zip(a, b):
            if x != y:
                return f"{path[:-1]}: {x} vs {y}"
        if len(a) != len(b):
            extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
            return f"{path[:-1]}: {len(a)} vs {len(b)} (first unmatched: {extra})"
        return None
    return None if a == b else f"{path[:-1]}: {a!r} vs {b!r}"


def check_ranks_agree(model: torch.nn.Module, cfg: ZeroplusConfig, dp: Collectives, topology: dict[str, int]) -> None:
    """Raise the same ``ConfigError`` on every rank of ``dp`` unless all describe the same run."""
    description = describe_rank(model, cfg, topology)
    digests = dp.all_gather_objects(_digest(description))
    if len(set(digests)) == 1:
        return
    everything = dp.all_gather_objects(description)
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    difference = _first_difference(everything[0], everything[odd[0]], "")
    raise ConfigError(f"the ranks do not agree on what to train (checked at initialize, on rank {dp.rank}): rank 0 "
                      f"and rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} differ; the first difference "
                      f"(rank 0 vs rank {odd[0]}): {difference}. Every rank must pass the same config and the same "
                      f"model")


def agree_on_budget(cfg: ZeroplusConfig, dp: Collectives) -> ZeroplusConfig:
    """``cfg`` with the smallest ``zeroplus.memory_budget`` of the ranks of ``dp`` (all of which set one): a budget
    that holds on every rank. ``cfg`` itself where they all gave the same bytes."""
    assert cfg.zeroplus.memory_budget is not None
    mine = parse_bytes(cfg.zeroplus.memory_budget)
    budgets = [int(b) for b in dp.all_gather_objects(mine)]
    least, most = min(budgets), max(budgets)
    if least == most:
        return cfg
    level = logging.WARNING if most > least * 1.01 else logging.INFO
    log_rank0("config key 'zeroplus.memory_budget' differs between ranks (%s bytes, rank by rank): every rank "
              "plans and trains in the smallest, %d", ", ".join(map(str, budgets)), least, level=level)
    out = copy.deepcopy(cfg)
    out.zeroplus.memory_budget = least
    return out
