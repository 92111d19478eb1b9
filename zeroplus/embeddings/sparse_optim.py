"""Row-sparse optimizers for embedding shards: only the rows a step looked up are read and written.

``SparseOptimizer(config, shard_weight)`` keeps its state beside one rank's shard of a table and applies
``update(rows, grad)``, ``rows`` unique local row indices and ``grad`` their summed gradients ``(k, cols)``.
No table-sized gradient exists; the states are table-shard-sized (below). The arithmetic per row is torch's
on a sparse gradient, operator for operator, so a row's update equals what ``torch.optim`` does to that row
of an ``nn.EmbeddingBag(sparse=True)`` given the same gradient values:

- ``"sgd"``: ``w -= lr * g`` (``torch.optim.SGD``). State: none.
- ``"adagrad"``: ``s += g^2``, ``w -= lr * g / (sqrt(s) + eps)`` (``torch.optim.Adagrad``'s sparse path, no
  decay). State: ``s``, ``rows x cols x 4`` bytes.
- ``"rowwise_adagrad"``: one accumulator per row, ``s += mean(g^2)`` over the row's columns, then as Adagrad
  (TorchRec's/FBGEMM's row-wise Adagrad; no torch twin: tested against a plain statement of it).
  State: ``rows x 4`` bytes. Under column-wise sharding the mean is over the whole row: the collection sums
  the squares over the column holders (``update``'s ``row_square_sum``), as one process would.
- ``"adam"``: lazy Adam, ``torch.optim.SparseAdam``: the moments of looked-up rows only, one step count per
  table shard, bias-corrected by it. State: ``2 x rows x cols x 4`` bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclass(frozen=True)
class SparseOptimConfig:
    """The embedding tables' optimizer (one for every table). ``eps`` None: torch's default for the type
    (Adagrad 1e-10, Adam 1e-8)."""
    type: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = "adagrad"
    lr: float = 0.01
    eps: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.type not in OPTIMIZERS:
            raise ValueError(f"embedding optimizer type must be one of {OPTIMIZERS}, got {self.type!r}")
        if self.lr < 0:
            raise ValueError(f"embedding optimizer lr must be >= 0, got {self.lr}")

    @property
    def epsilon(self) -> float:
        return self.eps if self.eps is not None else (1e-8 if self.type == "adam" else 1e-10)


def state_bytes(config: SparseOptimConfig, rows: int, cols: int) -> int:
    """The optimizer state's bytes for a ``rows x cols`` fp32 shard."""
    per = {"sgd": 0, "adagrad": rows * cols, "rowwise_adagrad": rows, "adam": 2 * rows * cols}[config.type]
    return 4 * per if cols else 0


class SparseOptimizer:
    def __init__(self, config: SparseOptimConfig, weight: torch.Tensor) -> None:
        self.config, self.weight = config, weight
        rows, cols = weight.shape
        self.step_count = 0
        self.state: dict[str, torch.Tensor] = {}
        if config.type == "adagrad":
            self.state["sum"] = torch.full_like(weight, config.initial_accumulator_value)
        elif config.type == "rowwise_adagrad":
            self.state["sum"] = torch.full((rows,), config.initial_accumulator_value, device=weight.device)
        elif config.type == "adam":
            self.state["exp_avg"] = torch.zeros_like(weight)
            self.state["exp_avg_sq"] = torch.zeros_like(weight)

    def update(self, rows: torch.Tensor, grad: torch.Tensor, row_square_sum: torch.Tensor | None = None,
               row_width: int = 0) -> None:
        """One optimizer step for this shard: ``rows`` (unique) get ``grad``; every other row is untouched.
        ``row_square_sum`` (row-wise Adagrad on a column shard): each row's sum of squared gradients over all
        ``row_width`` columns of the table, which the shard's own columns are part of."""
        self.step_count += 1
        if rows.numel() == 0 or self.weight.numel() == 0:
            return
        c, w = self.config, self.weight
        eps, lr = c.epsilon, c.lr
        old = w.index_select(0, rows)
        if c.type == "sgd":
            new = old.add(grad, alpha=-lr)
        elif c.type == "adagrad":
            s = self.state["sum"].index_select(0, rows).add(grad.pow(2))
            self.state["sum"].index_copy_(0, rows, s)
            new = old.add(grad / s.sqrt().add_(eps), alpha=-lr)
        elif c.type == "rowwise_adagrad":
            mean = grad.pow(2).mean(1) if row_square_sum is None else row_square_sum / row_width
            s = self.state["sum"].index_select(0, rows).add(mean)
            self.state["sum"].index_copy_(0, rows, s)
            new = old.add(grad / s.sqrt().add_(eps).unsqueeze(1), alpha=-lr)
        else:
            new = self._adam(rows, old, grad)
        w.index_copy_(0, rows, new)

    def _adam(self, rows: torch.Tensor, old: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        (beta1, beta2), st = self.config.betas, self.state
        old_avg = st["exp_avg"].index_select(0, rows)
        avg_update = grad.sub(old_avg).mul_(1 - beta1)
        st["exp_avg"].index_copy_(0, rows, old_avg + avg_update)
        old_sq = st["exp_avg_sq"].index_select(0, rows)
        sq_update = grad.pow(2).sub_(old_sq).mul_(1 - beta2)
        st["exp_avg_sq"].index_copy_(0, rows, old_sq + sq_update)
        numer = avg_update.add_(old_avg)
        denom = sq_update.add_(old_sq).sqrt_().add_(self.config.epsilon)
        step_size = self.config.lr * math.sqrt(1 - beta2 ** self.step_count) / (1 - beta1 ** self.step_count)
        return old + (-step_size * numer.div_(denom))


__all__ = ["OPTIMIZERS", "SparseOptimConfig", "SparseOptimizer", "state_bytes"]
