"""One rank of a tensor x pipeline x expert x data topology, simulated in one process for the estimate.

``virtual_groups`` makes the rank's groups (tensor, data, pipeline, expert, expert-data, model) as
``VirtualGroup`` stand-ins of the right sizes and ranks: a model built inside
``zeroplus.parallel.groups.using(groups)`` takes its slices from them as it would from process groups
(tensor-parallel layers their share of heads, MLP width and vocabulary, a ``PipelineModule`` its
stage's layers, an MoE layer its experts), and its collectives move nothing on the meta device but
allocate what they return (an all-gather's output is T times its input).

Pipelines: a stage receives activations whose shapes only earlier stages know. ``boundary_shapes``
builds every stage's module of this rank's pipeline on the meta device and runs one micro-batch
through the chunks in order, recording each chunk's input; ``SimulatedLinks`` then answers the
schedule's receives with meta tensors of those shapes and keeps what it "sends" until the batch ends,
as the real links keep their send buffers. The schedule itself is the real one
(``pipeline_schedule.train_batch``), so a stage holds the activations of as many micro-batches as
1F1B (or the interleaved schedule) keeps in flight.

Memory: none (meta tensors); time: one meta forward per pipeline stage, once.
See note: whole topology (docs/design-notes.md).
"""
from __future__ import annotations

from typing import Any, Callable, cast

import torch

from ..config import ZeroplusConfig
from ..parallel.groups import ParallelGroups, node_split, secondary_size, shard_size, using
from ..parallel.pipeline import PipelineModule
from ..parallel.pipeline_schedule import _Links
from ..parallel.topology import Topology
from .virtual_group import VirtualGroup


def topology_of(cfg: ZeroplusConfig, world_size: int) -> Topology:
    par = cfg.zeroplus.parallel
    return Topology(world_size, par.tensor, par.pipeline, par.expert, par.context,
                    experts_span_tensor=par.experts_span_tensor, shard=shard_size(cfg, world_size),
                    secondary=secondary_size(cfg, world_size), node=node_split(cfg, world_size))


def virtual_groups(cfg: ZeroplusConfig, world_size: int, rank: int, gloo_buffers: bool = False) -> ParallelGroups:
    """Rank ``rank``'s groups in the config's topology over ``world_size`` ranks, as stand-ins."""
    topology = topology_of(cfg, world_size)
    topology.coordinates(rank)  # names a rank outside the world
    return ParallelGroups(topology, rank, virtual=lambda r, n: VirtualGroup(r, n, gloo_buffers=gloo_buffers),
                          context_mode=cfg.zeroplus.parallel.context_mode,
                          ulysses_size=cfg.zeroplus.parallel.ulysses_size)


def build_in(groups: ParallelGroups, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` on the meta device, seeing ``groups`` as the process's parallel groups."""
    with using(groups), torch.device("meta"):
        return build()


def boundary_shapes(build: Callable[[], torch.nn.Module], groups: ParallelGroups, dtype: torch.dtype,
                    first_input: torch.Tensor) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """Global chunk -> (shape, dtype) of the activation it receives, from a meta forward of one micro-batch
    through every stage of this rank's pipeline (each built as its own rank would build it)."""
    top, c = groups.topology, groups.coordinates
    stages = []
    for q in range(top.pipeline):
        peer = ParallelGroups(top, top.rank_of(c.tensor, c.data, q),
                              virtual=lambda r, n: VirtualGroup(r, n))
        module = build_in(peer, build)
        if dtype != torch.float32:
            module.to(dtype)
        stages.append((peer, module))
    shapes, x = {}, first_input
    with torch.no_grad():
        for g in range(top.pipeline * cast(PipelineModule, stages[0][1]).virtual_stages):
            peer, module = stages[g % top.pipeline]
            if g > 0:
                shapes[g] = (tuple(x.shape), x.dtype)
            with using(peer):
                x = module(x, chunk=g // top.pipeline)
    return shapes


class SimulatedLinks(_Links):
    """The schedule's sends and receives on the meta device: receives are empty tensors of the recorded
    shapes; sends are kept until the batch ends (the real links keep their buffers as long)."""

    def __init__(self, module: Any, shapes: dict[int, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__(module)
        self.shapes = shapes

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.in_flight.append((None, tensor.contiguous()))

    def send_forward(self, activation: torch.Tensor, chunk: int) -> None:
        self._send(activation.detach(), 0, 0)

    def recv_forward(self, chunk: int) -> torch.Tensor:
        shape, dtype = self.shapes[chunk * self.P + self.rank]
        return torch.empty(shape, dtype=dtype, device="meta")

    def recv_backward(self, like: torch.Tensor, chunk: int) -> torch.Tensor:
        return torch.empty_like(like)

    def finish(self) -> None:
        self.in_flight.clear()

    def share_loss(self, loss: torch.Tensor) -> None:
        return None


__all__ = ["SimulatedLinks", "boundary_shapes", "build_in", "topology_of", "virtual_groups"]
