"""The 1F1B schedule of one training batch on one pipeline stage, with asynchronous sends and receives.

Stage ``s`` of ``P`` runs ``m = gradient_accumulation_steps`` micro-batches: ``min(P - s - 1, m)``
warm-up forwards, then alternately one forward and one backward until every forward is done, then
the remaining backwards. Sends are ``isend`` (a stage never waits for its neighbour to take what it
sent; the buffers are kept until the batch ends); receives wait. A forward activation travels with a
small header (dtype and shape); its gradient comes back with the shape the sender knows. Each
micro-batch's backward goes through the engine (loss scaling, gradient accumulation, ZeRO's reduction
on the last one) and ``engine.step()`` after it, so the optimizer steps once per batch.

Bubble: ``(P - 1) / (m + P - 1)`` of a batch's time is idle on average (``bench/bench_parallel.py``
measures it). Memory: a stage keeps the inputs and outputs of at most ``P - s`` micro-batches.
Communication per micro-batch: one activation forward and one gradient backward per stage boundary.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from .pipeline import PipelineModule

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]
_HEADER = 10  # dtype index, number of dims, up to 8 dims
_TAG_HEADER, _TAG_ACTIVATION, _TAG_GRADIENT = 1, 2, 3


class _Links:
    """Sends and receives to the previous and next stage of this rank's pipeline group."""

    def __init__(self, module: PipelineModule) -> None:
        pp = module.pp
        ranks = [dist.get_global_rank(pp.group, r) if pp.group is not None else r for r in range(pp.size)]
        self.prev = ranks[module.stage - 1] if module.stage > 0 else None
        self.next = ranks[module.stage + 1] if module.stage + 1 < pp.size else None
        self.last = ranks[-1]
        self.group = pp.group
        self.in_flight: list[tuple[Any, torch.Tensor]] = []  # isends and their buffers, until the batch ends

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.in_flight.append((dist.isend(tensor, peer, group=self.group, tag=tag), tensor))

    def send_forward(self, activation: torch.Tensor) -> None:
        if activation.dim() > _HEADER - 2 or activation.dtype not in _DTYPES:
            raise ValueError(f"pipeline stage output of shape {tuple(activation.shape)} and dtype {activation.dtype} "
                             f"cannot be sent: up to {_HEADER - 2} dims of {_DTYPES}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(activation.dtype), activation.dim()
        header[2:2 + activation.dim()] = torch.tensor(activation.shape)
        self._send(header, self.next, _TAG_HEADER)
        self._send(activation.detach(), self.next, _TAG_ACTIVATION)

    def recv_forward(self) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(header, self.prev, group=self.group, tag=_TAG_HEADER)
        shape = header[2:2 + int(header[1])].tolist()
        out = torch.empty(shape, dtype=_DTYPES[int(header[0])])
        dist.recv(out, self.prev, group=self.group, tag=_TAG_ACTIVATION)
        return out

    def send_backward(self, grad: torch.Tensor) -> None:
        self._send(grad, self.prev, _TAG_GRADIENT)

    def recv_backward(self, like: torch.Tensor) -> torch.Tensor:
        grad = torch.empty_like(like)
        dist.recv(grad, self.next, group=self.group, tag=_TAG_GRADIENT)
        return grad

    def finish(self) -> None:
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()


def train_batch(engine: Any, module: PipelineModule, data_iter: Iterator[Any]) -> torch.Tensor:
    """One batch of ``gradient_accumulation_steps`` micro-batches; every stage draws each micro-batch
    ``(inputs, targets)`` from ``data_iter`` (the first stage uses the inputs, the last the targets).
    Returns the mean loss of the batch on every stage of the pipeline."""
    m = engine.gradient_accumulation_steps()
    if engine.micro_steps % m:
        raise ValueError(f"train_batch() on rank {engine.dp.rank} after {engine.micro_steps} micro-steps: a "
                         f"batch must start at a gradient-accumulation boundary (every {m})")
    links = _Links(module)
    micro = [next(data_iter) for _ in range(m)]
    held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: list[torch.Tensor] = []

    def forward(i: int) -> None:
        x = micro[i][0] if module.is_first else links.recv_forward().requires_grad_()
        out = engine(x)
        if module.is_last:
            out = module.loss_fn(out, micro[i][1])
            losses.append(out.detach())
        else:
            links.send_forward(out)
        held[i] = (None if module.is_first else x, out)

    def backward(i: int) -> None:
        x, out = held.pop(i)
        engine.backward_stage(out, None if module.is_last else links.recv_backward(out))
        if x is not None:  # before the step: the last one's norm waits for every stage's gradients
            links.send_backward(x.grad)
        engine.step()

    warmup = min(module.num_stages - module.stage - 1, m)
    for i in range(warmup):
        forward(i)
    for i in range(m - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    links.finish()
    loss = torch.stack(losses).mean() if losses else torch.zeros(())
    if module.num_stages > 1:  # the last stage has it; every stage returns it
        dist.broadcast(loss, links.last, group=module.pp.group)
    return loss


__all__ = ["train_batch"]
