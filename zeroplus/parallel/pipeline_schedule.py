"""The 1F1B schedule of one training batch on one pipeline stage, with asynchronous sends and receives.

Stage ``s`` of ``P`` runs ``m = gradient_accumulation_steps`` micro-batches: ``min(P - s - 1, m)``
warm-up forwards, then alternately one forward and one backward until every forward is done, then
the remaining backwards. Sends are ``isend`` (a stage never waits for its neighbour to take what it
sent; the buffers are kept until the batch ends); receives wait. A forward activation travels with a
small header (dtype and shape); its gradient comes back with the shape the sender knows. Each
micro-batch's backward goes through the engine (loss scaling, gradient accumulation, ZeRO's reduction
on the last one) and ``engine.step()`` after it, so the optimizer steps once per batch.

Bubble: ``(P - 1) / (m + P - 1)`` of a batch's time is idle on average (``bench/bench_parallel.py``
measures it, and the time each stage waits in receives: ``module.last_recv_wait``). Memory: a stage keeps
the inputs and outputs of at most ``P - s`` micro-batches (one more with ``extra_warmup``).
Communication per micro-batch: one activation forward and one gradient backward per stage boundary.
See note: pipeline schedule (docs/design-notes.md).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .pipeline import PipelineModule

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]
_HEADER = 10  # dtype index, number of dims, up to 8 dims
_TAG_HEADER, _TAG_ACTIVATION, _TAG_GRADIENT = 1000, 2000, 3000  # + the receiving chunk


class _Links:
    """Sends and receives between this rank's chunks and their neighbours in the pipeline group.

    Global chunk ``g = c * P + r`` (local chunk c on pipeline rank r) feeds ``g + 1``: rank ``r + 1``,
    chunk c, or from the last rank rank 0, chunk ``c + 1``. Tags name the receiving chunk and the
    direction, so messages between two ranks match in order per chunk."""

    def __init__(self, module: PipelineModule) -> None:
        pp = module.pp
        self.ranks = [dist.get_global_rank(pp.group, r) if pp.group is not None else r for r in range(pp.size)]
        self.rank, self.P, self.v = module.stage, pp.size, module.virtual_stages
        self.group = pp.group
        self.in_flight: list[tuple[Any, torch.Tensor]] = []  # isends and their buffers, until the batch ends
        self.waited = 0.0  # seconds spent in receives: the bubble and the transfers not hidden

    def first(self, chunk: int) -> bool:
        return self.rank == 0 and chunk == 0

    def last(self, chunk: int) -> bool:
        return self.rank == self.P - 1 and chunk == self.v - 1

    def _after(self, chunk: int) -> tuple[int, int]:
        return (self.rank + 1, chunk) if self.rank + 1 < self.P else (0, chunk + 1)

    def _before(self, chunk: int) -> tuple[int, int]:
        return (self.rank - 1, chunk) if self.rank > 0 else (self.P - 1, chunk - 1)

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        tensor = tensor.contiguous()
        self.in_flight.append((dist.isend(tensor, self.ranks[peer], group=self.group, tag=tag), tensor))

    def send_forward(self, activation: torch.Tensor, chunk: int) -> None:
        if activation.dim() > _HEADER - 2 or activation.dtype not in _DTYPES:
            raise ValueError(f"pipeline stage output of shape {tuple(activation.shape)} and dtype {activation.dtype} "
                             f"cannot be sent: up to {_HEADER - 2} dims of {_DTYPES}")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(activation.dtype), activation.dim()
        header[2:2 + activation.dim()] = torch.tensor(activation.shape)
        peer, to_chunk = self._after(chunk)
        self._send(header, peer, _TAG_HEADER + to_chunk)
        self._send(activation.detach(), peer, _TAG_ACTIVATION + to_chunk)

    def recv_forward(self, chunk: int) -> torch.Tensor:
        started = time.perf_counter()
        peer = self.ranks[self._before(chunk)[0]]
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(header, peer, group=self.group, tag=_TAG_HEADER + chunk)
        out = torch.empty(header[2:2 + int(header[1])].tolist(), dtype=_DTYPES[int(header[0])])
        dist.recv(out, peer, group=self.group, tag=_TAG_ACTIVATION + chunk)
        self.waited += time.perf_counter() - started
        return out

    def send_backward(self, grad: torch.Tensor, chunk: int) -> None:
        peer, to_chunk = self._before(chunk)
        self._send(grad, peer, _TAG_GRADIENT + to_chunk)

    def recv_backward(self, like: torch.Tensor, chunk: int) -> torch.Tensor:
        started = time.perf_counter()
        grad = torch.empty_like(like)
        dist.recv(grad, self.ranks[self._after(chunk)[0]], group=self.group, tag=_TAG_GRADIENT + chunk)
        self.waited += time.perf_counter() - started
        return grad

    def finish(self) -> None:
        for work, _ in self.in_flight:
            work.wait()
        self.in_flight.clear()

    def share_loss(self, loss: torch.Tensor) -> None:
        """The last stage's loss on every stage."""
        if self.P > 1:
            dist.broadcast(loss, self.ranks[-1], group=self.group)

    def end_batch(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Wait for the sends; the batch's mean loss (the last stage's) on every stage."""
        self.finish()
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        self.share_loss(loss)
        return loss


def schedule(num_stages: int, stage: int, micro_batches: int, virtual_stages: int = 1,
             extra_warmup: bool = False) -> list[tuple[str, int, int]]:
    """This stage's operations in order: ``("F" | "B", micro-batch, local chunk)``.

    One chunk per rank: 1F1B. Several (Megatron's interleaved schedule): forwards go P micro-batches
    at a time through chunk 0, then chunk 1, ...; backwards the same way from the last chunk; the
    warm-up is ``2 (P - s - 1) + (v - 1) P`` forwards. ``extra_warmup``: one more (MindSpeed's VPP variant):
    in the steady state a stage's forward k and the backward after it then belong to micro-batches a
    whole round apart, so the gradient the backward receives was sent while the forward ran, and the
    forward's output is sent while the backward runs, instead of each waiting on the other. The backward
    order is unchanged (the same gradients, accumulated in the same order: the same losses bit for bit);
    each stage holds one more micro-batch's activations."""
    P, m, v = num_stages, micro_batches, virtual_stages
    if v == 1:
        forwards = [(i, 0) for i in range(m)]
        backwards = list(forwards)
        warmup = min(P - stage - 1, m)
    else:
        if m % P:
            raise ValueError(f"the interleaved schedule needs gradient_accumulation_steps ({m}) to be a multiple of "
                             f"the pipeline size ({P})")
        total = m * v

        def micro(k: int) -> int:
            return (k // (P * v)) * P + k % P
        forwards = [(micro(k), (k // P) % v) for k in range(total)]
        backwards = [(micro(k), v - 1 - (k // P) % v) for k in range(total)]
        warmup = min(2 * (P - stage - 1) + (v - 1) * P, total)
    warmup = min(warmup + int(extra_warmup), len(forwards))
    ops = [("F", *forwards[k]) for k in range(warmup)]
    for k in range(len(forwards) - warmup):
        ops += [("F", *forwards[warmup + k]), ("B", *backwards[k])]
    ops += [("B", *backwards[k]) for k in range(len(forwards) - warmup, len(forwards))]
    return ops


def train_batch(engine: Any, module: PipelineModule, data_iter: Iterator[Any], links: _Links | None = None,
                phase: Callable[[str], None] | None = None) -> torch.Tensor:
    """One batch of ``gradient_accumulation_steps`` micro-batches; every stage draws each micro-batch
    ``(inputs, targets)`` from ``data_iter`` (the first stage uses the inputs, the last the targets).
    Returns the mean loss of the batch on every stage of the pipeline. ``links`` and ``phase`` are the
    memory estimate's: stand-in sends and receives, and a call before each "forward", "backward" and
    "step" and after each forward ("end_forward")."""
    phase = phase if phase is not None else (lambda _: None)
    m = engine.gradient_accumulation_steps()
    if engine.micro_steps % m:
        raise ValueError(f"train_batch() on rank {engine.dp.rank} after {engine.micro_steps} micro-steps: a "
                         f"batch must start at a gradient-accumulation boundary (every {m})")
    links = links if links is not None else _Links(module)
    micro = [next(data_iter) for _ in range(m)]
    held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: list[torch.Tensor] = []
    ops = schedule(module.num_stages, module.stage, m, module.virtual_stages, getattr(module, "extra_warmup", False))
    last_backward = max(i for i, op in enumerate(ops) if op[0] == "B")
    for at, (kind, i, chunk) in enumerate(ops):
        if kind == "F":
            phase("forward")
            x = micro[i][0] if links.first(chunk) else links.recv_forward(chunk).requires_grad_()
            out = engine(x, chunk=chunk)
            if links.last(chunk):
                out = module.loss_fn(out, micro[i][1])
                losses.append(out.detach())
            else:
                links.send_forward(out, chunk)
            held[(i, chunk)] = (None if links.first(chunk) else x, out)
            phase("end_forward")
            continue
        phase("backward")
        x, out = held.pop((i, chunk))
        engine.backward_stage(out, None if links.last(chunk) else links.recv_backward(out, chunk),
                              reduce=at == last_backward)
        if x is not None:  # before the step: the last one's norm waits for every stage's gradients
            if x.grad is None:
                raise RuntimeError(f"pipeline chunk {chunk}: micro-batch {i}'s input got no gradient to send back")
            links.send_backward(x.grad, chunk)
        if chunk == 0:  # this micro-batch's last backward on this rank
            phase("step")
            engine.step()
    module.last_recv_wait = getattr(links, "waited", 0.0)
    return links.end_batch(losses)


def eval_batch(engine: Any, module: PipelineModule, data_iter: Iterator[Any]) -> torch.Tensor:
    """Forward only, no gradients: ``gradient_accumulation_steps`` micro-batches ``(inputs, targets)``
    through the stages in order (each chunk receives, runs, sends on); the mean loss on every stage.
    Memory: one micro-batch's activations per chunk at a time (nothing is kept for backward)."""
    links = _Links(module)
    losses: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(data_iter)
            for chunk in range(module.virtual_stages):
                x = inputs if links.first(chunk) else links.recv_forward(chunk)
                out = engine(x, chunk=chunk)
                if links.last(chunk):
                    losses.append(module.loss_fn(out, targets).float())
                else:
                    links.send_forward(out, chunk)
    return links.end_batch(losses)


__all__ = ["eval_batch", "schedule", "train_batch"]
