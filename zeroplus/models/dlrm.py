"""DLRM (Naumov et al., 2019): a bottom MLP over dense features, pooled embedding tables, their pairwise dot
products, and a top MLP giving one logit per sample.

    model = DLRM(DLRMConfig(dense_features=13, tables=[TableConfig("c0", 10**6, 16), ...]), SparseOptimConfig())
    loss = model(dense, sparse, labels)      # sparse: {table: (ids, offsets[, per_sample_weights])}

The tables live in an ``EmbeddingBagCollection`` (``zeroplus/embeddings``), sharded over the data-parallel
ranks as each ``TableConfig`` says and stepped by its row-sparse optimizer; the MLPs are ordinary parameters
that ZeRO partitions. Interaction: the bottom MLP's output ``x`` (``B x D``) and the ``T`` pooled tables
(``B x D`` each, so every table has ``dim == D``) stacked to ``B x (T + 1) x D``, their ``(T + 1) T / 2``
distinct pairwise dot products, concatenated with ``x`` into the top MLP. Memory per sample: the pooled
``T D`` and the ``(T + 1)^2`` products (autograd keeps the stack for the product's backward).
``synthetic_batch`` makes Criteo-like data: log-normal dense features, power-law ids, bags of 0-3 ids, and
labels from a fixed teacher (learnable: the loss falls below ``log 2``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import DataParallelGroup
from ..embeddings import EmbeddingBagCollection, SparseOptimConfig, TableConfig
from ..embeddings.tables import TableTier


@dataclass(frozen=True)
class DLRMConfig:
    dense_features: int = 13
    tables: Sequence[TableConfig] = field(default_factory=list)
    bottom: Sequence[int] = (64, 16)  # hidden widths; the last is the embedding dimension D
    top: Sequence[int] = (64, 32)  # hidden widths before the logit

    def __post_init__(self) -> None:
        if not self.tables:
            raise ValueError("DLRMConfig.tables is empty: a DLRM needs at least one embedding table")
        dim = self.bottom[-1]
        wrong = [f"{t.name} ({t.dim})" for t in self.tables if t.dim != dim]
        if wrong:
            raise ValueError(f"DLRMConfig: every table's dim must equal the bottom MLP's output {dim} (the dot "
                             f"interaction), not: {', '.join(wrong)}")


# the 26 categorical features' cardinalities in Criteo's Kaggle display-advertising set (33.8M rows in all)
CRITEO_ROWS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
               10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


def criteo_config(dim: int = 16, max_rows: int | None = None, sharding: str = "auto",
                  bottom: Sequence[int] = (512, 256), top: Sequence[int] = (512, 256),
                  cache_rows: int | None = None) -> DLRMConfig:
    """DLRM on Criteo's shape: 13 dense features, 26 tables of ``CRITEO_ROWS`` rows (each at most ``max_rows``,
    as DLRM's ``--max-ind-range`` hashes ids into), ``dim`` columns, the MLPs of the reference model (the
    bottom's last width ``dim``). ``cache_rows``: tables of more rows live on the collection's tier, that many
    hot rows in memory."""
    def table(i: int, n: int) -> TableConfig:
        rows = min(n, max_rows or n)
        cached = cache_rows if cache_rows is not None and rows > cache_rows else None
        return TableConfig(f"c{i}", rows, dim, sharding=sharding, cache_rows=cached)  # type: ignore[arg-type]
    tables = [table(i, n) for i, n in enumerate(CRITEO_ROWS)]
    return DLRMConfig(dense_features=13, tables=tables, bottom=(*bottom, dim), top=top)


def mlp(widths: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, cfg: DLRMConfig, optimizer: SparseOptimConfig | None = None,
                 group: DataParallelGroup | None = None, seed: int = 0, tier: TableTier | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        n = len(cfg.tables) + 1
        self.bottom = mlp([cfg.dense_features, *cfg.bottom], last_relu=True)
        self.embeddings = EmbeddingBagCollection(cfg.tables, optimizer, group, seed, tier)  # tier: cached tables
        self.top = mlp([cfg.bottom[-1] + n * (n - 1) // 2, *cfg.top, 1], last_relu=False)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self._pairs: torch.Tensor
        self.register_buffer("_pairs", rows * n + cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: dict, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.embeddings(sparse).to(x.dtype)
        features = torch.cat([x, pooled], 1).view(x.shape[0], -1, x.shape[1])  # B x (T + 1) x D
        products = torch.bmm(features, features.transpose(1, 2)).flatten(1).index_select(1, self._pairs)
        logit = self.top(torch.cat([x, products], 1)).squeeze(1)
        return logit if labels is None else F.binary_cross_entropy_with_logits(logit, labels.to(logit.dtype))


def synthetic_batch(cfg: DLRMConfig, batch: int, generator: torch.Generator,
                    alpha: float = 1.2) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(dense, sparse, labels) for ``batch`` samples: Criteo-like, ids drawn by a power law of exponent
    ``alpha`` over each table's rows (row 0 the most frequent), 0-3 ids per bag. Labels are drawn from a fixed
    teacher, so there is something to learn: the click probability is the sigmoid of each table's mean id
    effect (a hash of the id, in [-1, 1)) plus the first dense feature's log."""
    dense = torch.randn(batch, cfg.dense_features, generator=generator).exp()
    sparse = {}
    logit = dense[:, 0].log()
    for t in cfg.tables:
        lengths = torch.randint(0, 4, (batch,), generator=generator)
        u = torch.rand(int(lengths.sum()), generator=generator)
        top = (t.num_embeddings + 1) ** (1 - alpha)  # the inverse CDF of x^-alpha on [1, rows + 1)
        ids = (((top - 1) * u + 1) ** (1 / (1 - alpha))).floor().long() - 1
        ids = ids.clamp(0, t.num_embeddings - 1)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        sparse[t.name] = (ids, offsets)
        effect = (ids * 2654435761 % 65536).float() / 32768 - 1
        bags = torch.repeat_interleave(torch.arange(batch), lengths)
        logit = logit + torch.zeros(batch).index_add_(0, bags, effect) / lengths.clamp(min=1)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
    return dense, sparse, labels


__all__ = ["CRITEO_ROWS", "DLRM", "DLRMConfig", "criteo_config", "mlp", "synthetic_batch"]
