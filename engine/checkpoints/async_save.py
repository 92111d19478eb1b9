"""Asynchronous saves: ``save_checkpoint`` returns once this rank's state is staged; the file, its fsync and the
commit happen in the background.

In ``save_checkpoint`` (every rank) everything a synchronous save does before its file happens as usual (the
tag agreed, the temporary directory made, the metadata put together); then ``allocate`` gives every tensor
of this rank's state a host buffer of its own (pinned where a device is; the ledger's ``offload_buffer``: one
rank file's worth, 12 bytes per owned parameter with Adam in fp32, plus rank 0's buffers and frozen
parameters) and a thread copies the state into them, then writes it. Nothing changes the masters and
optimizer states between two optimizer steps (forward and backward only read them; loading and
``destroy()`` wait for the save), so the copy overlaps the next forward and backward, and the next optimizer
step waits until it is done (``wait_staged``): the training time a save blocks is the part of the copy
that the forward and backward did not hide. The thread then exchanges the outcome and the file digests over a process
group of its own (gloo, made by every rank at the first asynchronous save, so its collectives never interleave
with training's); rank 0 writes the metadata, renames the directory into place, points ``latest`` at it and
applies ``keep_latest_k``, and the ranks exchange that outcome too. A failure anywhere: rank 0 removes the
temporary directory, the previous checkpoint and ``latest`` stay, and every rank's thread holds the error.

Who waits (``PendingSave``): the next save, ``load_checkpoint`` and ``destroy()`` join the thread and raise its
failure; ``step()`` asks, with one flag all-reduced over the data group and only while a save is pending,
whether every rank's thread is done, and raises a failure on every rank at the same step. The thread is not
a daemon: the interpreter's exit waits for it (before the process group is destroyed: ``engine.destroy()``
or a finished step first). The staged copy is freed once the file is written.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist

from zeroplus.accelerator import Accelerator
from zeroplus.collectives import Collectives
from zeroplus.comm import DataParallelGroup
from zeroplus.ledger import Category, Ledger

from . import files as io

logger = logging.getLogger("zeroplus.checkpoint")


def allocate(state: Any, accelerator: Accelerator, ledger: Ledger
             ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """``state`` with every tensor replaced by an empty host buffer of its own (pinned where a device is; each
    charged to the ledger's ``offload_buffer`` until released), the ``(source, buffer)`` pairs still to copy,
    and the buffers. Allocated on the caller's thread (the ledger is not shared with the save's thread)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    copies: list[torch.Tensor] = []

    def place(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":  # the estimator's simulated save: shapes only
                host = torch.empty(value.shape, dtype=value.dtype, device="meta")
            else:
                host = accelerator.pin_memory(torch.empty(value.shape, dtype=value.dtype))
                pairs.append((value.detach(), host))
            copies.append(ledger.track(host, Category.OFFLOAD_BUFFER))
            return host
        if isinstance(value, dict):
            return {k: place(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(place(v) for v in value)
        return value
    return place(state), pairs, copies


def stage(state: Any, accelerator: Accelerator, ledger: Ledger) -> tuple[Any, list[torch.Tensor]]:
    """``state`` copied into host memory of its own now (``allocate`` and the copies), and the copies."""
    staged, pairs, copies = allocate(state, accelerator, ledger)
    for source, host in pairs:
        host.copy_(source)
    return staged, copies


def background_group(world: Collectives) -> Collectives:
    """A process group of the same ranks for the background thread's collectives (every rank calls it)."""
    if not world.initialized or world.size == 1:
        return world
    ranks = dist.get_process_group_ranks(world.group) if world.group is not None else None
    return DataParallelGroup(dist.new_group(ranks=ranks, backend="gloo"), label="checkpoint")


class PendingSave:
    """One checkpoint on its way to disk; ``error`` is set (on every rank) if it did not get there."""

    def __init__(self, final_dir: str, group: Collectives, global_rank: int) -> None:
        self.final_dir, self.group, self.global_rank = final_dir, group, global_rank
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.staged = threading.Event()  # set once the thread has copied the state (or failed to)

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def start(self, job: dict[str, Any]) -> None:
        self.thread = threading.Thread(target=self._run, args=(job,), name="zeroplus-checkpoint-save")
        self.thread.start()

    def wait(self) -> None:
        """Join the thread; raise its failure (the same on every rank)."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error

    def wait_staged(self) -> None:
        """Until the thread has copied the state: what the next optimizer step may then change."""
        if self.thread is not None:
            self.staged.wait()

    def _run(self, job: dict[str, Any]) -> None:
        group, rank, tmp_dir = self.group, self.group.rank, job["tmp_dir"]
        digest, error = None, None
        try:
            try:
                for source, host in job.pop("pairs"):
                    host.copy_(source)
            finally:
                self.staged.set()
            os.makedirs(tmp_dir, exist_ok=True)
            digest = io.save_rank_state(tmp_dir, job["dp_rank"], job["state"], self.global_rank)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it
            error = err
        finally:
            for t in job.pop("copies"):
                job["ledger"].release(t)
            job.pop("state")
        try:
            outcomes = group.all_gather_objects((digest, None if error is None else f"{type(error).__name__}: {error}"))
            failures = [f"rank {r}: {o}" for r, (_, o) in enumerate(outcomes) if o is not None]
            committed = None
            if not failures and rank == 0:
                try:
                    metadata = dict(job["metadata"], files={str(r): d for r, (d, _) in enumerate(outcomes)})
                    io.commit(tmp_dir, self.final_dir, metadata)
                    if job["save_latest"]:
                        io.write_latest(job["save_dir"], job["tag"])
                    if job["keep_k"] is not None:
                        io.keep_latest(job["save_dir"], job["keep_k"], job["tag"])
                except Exception as err:  # noqa: BLE001
                    committed = f"rank 0 could not commit: {type(err).__name__}: {err}"
            if not failures:
                failures = [o for o in group.all_gather_objects(committed) if o is not None]
            if failures:
                if rank == 0:
                    shutil.rmtree(tmp_dir, ignore_errors=True)
                self.error = RuntimeError(
                    f"asynchronous checkpoint {self.final_dir} was not saved (rank {self.global_rank}): "
                    + "; ".join(failures) + f"; {io.LATEST} still names the previous checkpoint")
        except Exception as err:  # noqa: BLE001 - the exchange itself failed (a rank gone)
            self.error = RuntimeError(f"asynchronous checkpoint {self.final_dir} (rank {self.global_rank}): the "
                                      f"ranks could not agree on its outcome: {type(err).__name__}: {err}")
        if self.error is not None:
            logger.error("%s", self.error)


class AsyncSaves:
    """An engine's asynchronous saves: at most one pending, the background group made once."""

    def __init__(self) -> None:
        self.pending: PendingSave | None = None
        self._group: Collectives | None = None

    def group(self, world: Collectives) -> Collectives:
        """The background thread's group (made at the first asynchronous save: every rank is there)."""
        if self._group is None:
            self._group = background_group(world)
        return self._group

    def start(self, pending: PendingSave, job: dict[str, Any]) -> None:
        self.pending = pending
        pending.start(job)

    def wait(self) -> None:
        """Join the pending save, if any, and raise its failure."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def wait_staged(self) -> None:
        """Before the optimizer step changes the masters and states: the pending save has its copy of them."""
        if self.pending is not None:
            self.pending.wait_staged()

    def poll(self, dp: Collectives) -> None:
        """At a step: once every rank's pending save is done (one flag over ``dp``), finish it, raising its
        failure on every rank at this same step."""
        if self.pending is not None and not dp.max_flag(not self.pending.done):
            self.wait()
