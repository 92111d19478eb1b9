"""Tensor-parallel layers (Megatron's scheme) over the tensor group ``T`` of ``parallel_groups()``.

- ``ColumnParallelLinear(in, out)``: this rank holds rows ``[t * out/T, (t+1) * out/T)`` of the weight
  (and that slice of the bias); output ``(..., out/T)``. Input: whole (``copy_to_tensor``: its gradient
  is all-reduced) or, with sequence parallelism, split along the sequence (gathered, overlapped with the
  matmul, ``overlap.py``). ``gather_output``: the slices all-gathered into the whole ``(..., out)`` on every
  rank (a head whose logits the model's own loss reads).
- ``RowParallelLinear(in, out)``: this rank holds columns ``[t * in/T, ...)``; input ``(..., in/T)``;
  the partial outputs are all-reduced, or reduce-scattered along the sequence with sequence parallelism.
  The bias is whole on every rank and added once, after the reduction.
- ``VocabParallelEmbedding(vocab, dim)``: rows ``[t * vocab/T, ...)`` of the table; ids outside them
  look up zeros and the all-reduce fills them in; ``padding_idx``'s row gets no gradient, as in ``nn.Embedding``.
- ``vocab_parallel_cross_entropy(logits_l, targets)``: cross entropy over logits split along the vocab
  (max, sum of exponentials and the target's logit are all-reduced: three scalars per token), without
  gathering the ``(tokens, vocab)`` logits.
- ``SequenceParallelLayerNorm``: a LayerNorm whose weight and bias gradients are summed over the
  tensor group (each rank normalised only its part of the sequence).

Which parameters are split is recorded here (``is_tensor_parallel``), so the gradient norm counts a
replicated parameter once, not T times. Memory per rank: 1/T of each split weight; activations
``(s, b, out/T)`` inside a region, ``(s/T, b, d)`` between regions with sequence parallelism.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import DataParallelGroup
from .groups import parallel_groups
from .mappings import (
    all_reduce,
    copy_to_tensor,
    gather_last_dim,
    reduce_from_tensor,
    reduce_scatter_sequence,
    scatter_last_dim,
    sum_grad_over_tensor,
)
from .overlap import all_gather_matmul, matmul_reduce_scatter
from .registry import ParameterSet

_SPLIT = ParameterSet()


def mark_tensor_parallel(param: torch.Tensor) -> torch.Tensor:
    """Record that ``param`` holds this rank's slice of a tensor split over the tensor group."""
    return _SPLIT.add(param)


def tensor_parallel_marks() -> ParameterSet:
    """The set ``mark_tensor_parallel`` adds to (for a split that may be undone)."""
    return _SPLIT


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return param in _SPLIT


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} = {total} does not split over a tensor-parallel group of {parts} ranks")
    return total // parts


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sequence_parallel: bool = False,
                 overlap_chunks: int = 1, gather_output: bool = False, tp: DataParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else parallel_groups().tensor
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.out_per_rank = _divide(out_features, self.tp.size, "ColumnParallelLinear out_features")
        self.sequence_parallel, self.overlap_chunks = sequence_parallel, overlap_chunks
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(self.out_per_rank, in_features)))  # (o/T, i)
        self.bias = mark_tensor_parallel(nn.Parameter(torch.zeros(self.out_per_rank))) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: (s/T, b, i) -> (s, b, o/T)
            y = all_gather_matmul(x, self.weight, self.bias, self.tp, self.overlap_chunks)
        else:
            y = F.linear(copy_to_tensor(x, self.tp), self.weight, self.bias)
        return gather_last_dim(y, self.tp) if self.gather_output else y

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Take this rank's rows of a whole ``(out, in)`` weight (and bias)."""
        with torch.no_grad():
            self.weight.copy_(weight.chunk(self.tp.size, 0)[self.tp.rank])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias.chunk(self.tp.size, 0)[self.tp.rank])

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (this rank {self.out_per_rank}), "
                f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``split_input``: the input arrives whole on every rank (Transformers' ``rowwise_split_input``: Olmo2's
    ``o_proj`` after attention run whole), and this rank multiplies its part of the last dimension; the parts'
    gradients are gathered back, so every rank's input gradient is whole as its input was."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, sequence_parallel: bool = False,
                 overlap_chunks: int = 1, split_input: bool = False, tp: DataParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None else parallel_groups().tensor
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide(in_features, self.tp.size, "RowParallelLinear in_features")
        self.sequence_parallel, self.overlap_chunks, self.split_input = sequence_parallel, overlap_chunks, split_input
        if split_input and sequence_parallel:
            raise ValueError("RowParallelLinear: split_input takes a whole input, sequence_parallel a sharded one")
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(out_features, self.in_per_rank)))  # (o, i/T)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # whole: added after the sum
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: (s, b, i/T) -> (s/T, b, o)
            y = matmul_reduce_scatter(x, self.weight, self.tp, self.overlap_chunks)
            return y + sum_grad_over_tensor(self.bias, self.tp) if self.bias is not None else y
        if self.split_input:
            x = scatter_last_dim(x, self.tp)
        y = reduce_from_tensor(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Take this rank's columns of a whole ``(out, in)`` weight, and the whole bias."""
        with torch.no_grad():
            self.weight.copy_(weight.chunk(self.tp.size, 1)[self.tp.rank])
            if self.bias is not None and bias is not None:
                self.bias.copy_(bias)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (this rank {self.in_per_rank}), out={self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}" + (", split_input=True" if self.split_input else ""))


class ReplicatedRowsLinear(nn.Module):
    """A linear whose whole ``(out, in)`` weight (and bias) every tensor rank holds, of which this rank computes rows
    ``[start, stop)``: grouped-query attention's key/value heads where the tensor group outnumbers them, so the ranks
    whose query heads share a key/value head each compute it. The weight is the model's own parameter; its gradient
    (this rank's rows) and the input's are summed over the tensor group, so every rank holds the whole gradient, as
    a replicated parameter should (counted once in the norm: not ``is_tensor_parallel``)."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, tp: DataParallelGroup) -> None:
        super().__init__()
        self.tp, self.start, self.stop = tp, start, stop
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sum_grad_over_tensor(self.weight, self.tp)[self.start:self.stop]
        bias = None if self.bias is None else sum_grad_over_tensor(self.bias, self.tp)[self.start:self.stop]
        return F.linear(copy_to_tensor(x, self.tp), weight, bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (this rank rows {self.start}:{self.stop}, whole held)"


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, *, sequence_parallel: bool = False,
                 padding_idx: int | None = None, tp: DataParallelGroup | None = None) -> None:
        """``sequence_parallel``: ids are ``(seq, ...)`` and each rank gets its slice of the sequence, by one
        reduce-scatter (half the bytes of the all-reduce that would give every rank the whole)."""
        super().__init__()
        self.tp = tp if tp is not None else parallel_groups().tensor
        self.sequence_parallel = sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = _divide(num_embeddings, self.tp.size, "VocabParallelEmbedding num_embeddings")
        self.start = self.tp.rank * self.per_rank
        self.padding_idx = padding_idx
        local_pad = None if padding_idx is None else padding_idx % num_embeddings - self.start
        self._local_pad = local_pad if local_pad is not None and 0 <= local_pad < self.per_rank else None
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(self.per_rank, embedding_dim)))  # (V/T, d)
        nn.init.normal_(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` of any shape -> ``ids.shape + (dim,)``, whole on every rank (or this rank's sequence slice)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight, self._local_pad)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self._local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.tp)
        return reduce_from_tensor(out, self.tp)

    def load_dense(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.weight.copy_(weight[self.start:self.start + self.per_rank])


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, start: int,
                tp: DataParallelGroup) -> torch.Tensor:
        logits = logits.float()  # (n, V/T)
        top = logits.max(dim=-1).values
        tp.all_reduce(top, op=dist.ReduceOp.MAX).wait()
        shifted = logits - top.unsqueeze(-1)
        local = targets - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(-1), picked])  # one all-reduce for both
        all_reduce(sums, tp)
        sum_exp, target_logit = sums[0], sums[1]
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, local, outside)
        return sum_exp.log() - target_logit  # (n,)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local] -= (~outside).to(grad_logits.dtype)
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits_l: torch.Tensor, targets: torch.Tensor, start: int,
                                 tp: DataParallelGroup | None = None) -> torch.Tensor:
    """Per-token loss ``(n,)`` from this rank's vocab slice ``logits_l (n, V/T)`` starting at ``start``.
    Memory: the fp32 softmax of the slice, ``n * V/T * 4`` bytes, kept for backward."""
    tp = tp if tp is not None else parallel_groups().tensor
    if tp.size == 1:
        return F.cross_entropy(logits_l.float(), targets, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits_l, targets, start, tp)


class SequenceParallelLayerNorm(nn.LayerNorm):
    def __init__(self, normalized_shape: int, *, tp: DataParallelGroup | None = None, **kwargs: Any) -> None:
        super().__init__(normalized_shape, **kwargs)
        self.tp = tp if tp is not None else parallel_groups().tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sum_grad_over_tensor(self.weight, self.tp) if self.weight is not None else None
        bias = sum_grad_over_tensor(self.bias, self.tp) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


__all__ = ["ColumnParallelLinear", "ReplicatedRowsLinear", "RowParallelLinear", "SequenceParallelLayerNorm",
           "VocabParallelEmbedding", "is_tensor_parallel", "mark_tensor_parallel", "reduce_scatter_sequence",
           "vocab_parallel_cross_entropy"]
