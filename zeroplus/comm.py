"""Communication: the data-parallel group and async collectives that return handles.

Every collective is issued with ``async_op=True`` and returns a ``Handle`` whose ``wait()`` runs
at the last moment the result is needed. With world size 1 the collectives complete at once
without calling torch.distributed, so one code path serves 1 and N ranks. Bytes sent per
collective kind are counted for reports and benchmarks.
"""
from __future__ import annotations

import collections
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from .accelerator import get_accelerator


def init_distributed_if_launched() -> None:
    """Initialise torch.distributed when a launcher set RANK/WORLD_SIZE and nobody has yet."""
    if not dist.is_available() or dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        accel = get_accelerator()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        accel.set_device(local_rank)
        dist.init_process_group(backend=accel.comm_backend)


class Handle:
    """An in-flight collective; ``wait()`` blocks, then runs the completion callback once."""

    def __init__(self, work: Any | None, on_done: Callable[[], None] | None = None) -> None:
        self._work = work
        self._on_done = on_done
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None  # the work object references its tensors: drop them with it
        self.done = True
        if self._on_done is not None:
            self._on_done()
            self._on_done = None


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DataParallelGroup:
    """A process group with rank, size and counted async collectives (sum reductions)."""

    def __init__(self, group: Any | None = None) -> None:
        self.initialized = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.initialized else 0
        self.size = dist.get_world_size(group) if self.initialized else 1
        self.bytes_sent: collections.Counter[str] = collections.Counter()

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes_sent[kind] += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, on_done: Callable[[], None] | None = None) -> Handle:
        if self.size == 1:
            return Handle(None, on_done)
        self._count("all_reduce", tensor)
        op = dist.ReduceOp.SUM if op is None else op
        return Handle(dist.all_reduce(tensor, op=op, group=self.group, async_op=True), on_done)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       on_done: Callable[[], None] | None = None) -> Handle:
        """Sum ``input`` (``size * output.numel()`` elements) over ranks; rank r gets chunk r."""
        if self.size == 1:
            output.copy_(input)
            return Handle(None, on_done)
        self._count("reduce_scatter", input)
        return Handle(_reduce_scatter(output, input, group=self.group, async_op=True), on_done)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor,
                   on_done: Callable[[], None] | None = None) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` (rank order)."""
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None, on_done)
        self._count("all_gather", output)
        return Handle(_all_gather(output, input, group=self.group, async_op=True), on_done)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        """Chunk i of ``input`` (dim 0 in ``size`` equal parts) to rank i; chunk r of ``output`` from rank r."""
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle(None)
        self._count("all_to_all", input)
        return Handle(dist.all_to_all_single(output, input, group=self.group, async_op=True))

    def max_flag(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (used for fp16 overflow)."""
        if self.size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=get_accelerator().device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item() > 0)

    def sum_scalar(self, value: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(value, group=self.group)
        return value

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small Python objects: paths, names)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                   group=self.group)
        return box[0]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (small Python objects)."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
