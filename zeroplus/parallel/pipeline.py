"""Pipeline parallelism: a sequential model cut into stages, one per rank of the pipeline group.

    layers = gpt_pipeline_layers(GPT(cfg))                       # or any list of modules, in order
    model = PipelineModule(layers, loss_fn=lambda logits, y: ...)  # this rank keeps its stage's layers
    engine = zeroplus.initialize(model, config)                  # "zeroplus": {"parallel": {"pipeline": P}}
    loss = engine.train_batch(data_iter)                         # gradient_accumulation_steps micro-batches

Stages get consecutive layers, as equal in count as possible (or ``boundaries``). Between stages one
tensor travels per micro-batch: the activation forward, its gradient backward, by asynchronous
sends and receives in the pipeline group (``pipeline_schedule.py`` runs 1F1B: ``P - s - 1``
warm-up forwards on stage ``s``, then one forward and one backward in turn, then the remaining
backwards). Memory per stage: its layers' parameters, gradients and optimizer states (ZeRO 1-2 over
its data group), and the activations of at most ``P - s`` micro-batches in flight.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..comm import DataParallelGroup
from .groups import parallel_groups


def uniform_boundaries(num_layers: int, num_stages: int) -> list[int]:
    """``num_stages + 1`` cut points: stage ``s`` holds layers ``[b[s], b[s+1])``."""
    if num_layers < num_stages:
        raise ValueError(f"a pipeline of {num_stages} stages needs at least {num_stages} layers, got {num_layers}")
    return [num_layers * s // num_stages for s in range(num_stages + 1)]


class PipelineModule(nn.Module):
    def __init__(self, layers: Sequence[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor], *,
                 boundaries: Sequence[int] | None = None, virtual_stages: int = 1,
                 pp: DataParallelGroup | None = None, extra_warmup: bool = False) -> None:
        """``virtual_stages`` v > 1: the layers are cut into ``P * v`` chunks and this rank holds chunks
        ``stage, stage + P, ...`` (the interleaved schedule: the bubble shrinks by v, the sends grow by v);
        ``boundaries`` then has ``P * v + 1`` cut points. ``extra_warmup``: one more warm-up forward on every
        stage (``pipeline_schedule.schedule``): a forward's send and the backward beside it no longer wait on
        each other, for one more micro-batch's activations held."""
        super().__init__()
        self.extra_warmup = extra_warmup
        self.last_recv_wait = 0.0  # seconds the last train_batch waited in receives (pipeline_schedule.py)
        self.pp = pp if pp is not None else parallel_groups().pipeline
        self.stage, self.num_stages, self.virtual_stages = self.pp.rank, self.pp.size, virtual_stages
        if virtual_stages < 1:
            raise ValueError(f"virtual_stages must be at least 1, got {virtual_stages}")
        chunks = self.num_stages * virtual_stages
        bounds = list(boundaries) if boundaries is not None else uniform_boundaries(len(layers), chunks)
        if len(bounds) != chunks + 1 or bounds[0] != 0 or bounds[-1] != len(layers) or \
                any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"pipeline boundaries {bounds} must rise from 0 to {len(layers)} layers in "
                             f"{chunks} non-empty chunks ({self.num_stages} stages x {virtual_stages} virtual)")
        self.boundaries = bounds
        mine = [c * self.num_stages + self.stage for c in range(virtual_stages)]  # global chunk of each local one
        self.chunk_first = [bounds[g] for g in mine]  # first global layer of each local chunk
        kept: list[torch.nn.Module] = []
        self.chunk_slices, at = [], 0
        for g in mine:
            kept.extend(layers[bounds[g]:bounds[g + 1]])
            self.chunk_slices.append((at, at + bounds[g + 1] - bounds[g]))
            at += bounds[g + 1] - bounds[g]
        self.layers = nn.ModuleList(kept)
        self.first_layer = self.chunk_first[0]
        self.loss_fn = loss_fn

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(self, x: Any, chunk: int = 0) -> Any:
        a, b = self.chunk_slices[chunk]
        for layer in self.layers[a:b]:
            x = layer(x)
        return x

    def global_layer(self, local_name: str) -> str:
        """``layers.3.attn.qkv.weight`` on this rank -> its index in the whole model's layer numbering."""
        _, index, rest = local_name.split(".", 2)
        i = int(index)
        chunk = next(c for c, (a, b) in enumerate(self.chunk_slices) if a <= i < b)
        return f"{self.chunk_first[chunk] + i - self.chunk_slices[chunk][0]}.{rest}"

    def extra_repr(self) -> str:
        spans = [f"{first}..{first + b - a - 1}" for first, (a, b) in zip(self.chunk_first, self.chunk_slices)]
        return f"stage {self.stage} of {self.num_stages}: layers {', '.join(spans)}"


__all__ = ["PipelineModule", "uniform_boundaries"]
