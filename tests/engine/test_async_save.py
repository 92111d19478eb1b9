"""Asynchronous saves: ``save_checkpoint(..., async_save=True)``.

Covers, on 2 gloo ranks at ZeRO-2 and 3: the save returns, training goes on, and the committed checkpoint holds
exactly what a synchronous save at the same point holds (every tensor of every rank file bitwise), although
the state is copied in the background while the next step runs (held back half a second here: that step's
optimizer step waits for the copy); the staged
copy was charged to the ledger's ``offload_buffer`` (its peak at least the rank file's tensors) and freed once
written. A background write that fails half-way on one rank is raised on every rank at the same later
``step()``, naming the file and the rank; the previous checkpoint and ``latest`` stay, and nothing of the
failed one is left.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from zeroplus.engine.checkpoints import async_save
from zeroplus.engine.checkpoints import files as io
from zeroplus.ledger import Category


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _step(engine, k: int) -> None:
    rank, world = rank_and_world()
    x, y = make_batches(8 * world, 2)[(k * world + rank) % (8 * world)]
    engine.backward(engine(x, y))
    engine.step()


def _tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _tensors(item, f"{prefix}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _tensors(item, f"{prefix}[{i}]").items()}
    return {}


def _same_as_sync(root: str, stage: int) -> dict:
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(stage))
    for k in range(2):
        _step(engine, k)
    engine.save_checkpoint(os.path.join(root, "sync"), tag="t")
    run = async_save.PendingSave._run

    def slow_copy(self, job):  # the copy starts late, as a large model's ends late: the step must wait for it
        time.sleep(0.5)
        run(self, job)
    async_save.PendingSave._run = slow_copy
    start = time.perf_counter()
    path = engine.save_checkpoint(os.path.join(root, "async"), tag="t", async_save=True)
    returned = time.perf_counter() - start
    _step(engine, 2)  # training goes on while the file is written
    engine.wait_for_checkpoint()
    files = [torch.load(os.path.join(root, name, "t", io.rank_file(rank)), weights_only=True)
             for name in ("sync", "async")]
    staged = sum(t.numel() * t.element_size() for t in _tensors(files[1]).values())
    with open(os.path.join(root, "async", "latest")) as f:
        latest = f.read()
    ledger = engine.ledger
    return {"path": path, "returned": returned, "files": [_tensors(f) for f in files], "latest": latest,
            "peak": ledger.peak_bytes(Category.OFFLOAD_BUFFER), "live": ledger.live_bytes(Category.OFFLOAD_BUFFER),
            "staged": staged}


@pytest.mark.parametrize("stage", [2, 3])
def test_an_asynchronous_save_holds_what_a_synchronous_one_does(tmp_path, stage):
    for rank, got in enumerate(run_distributed(_same_as_sync, 2, str(tmp_path), stage)):
        assert got["path"] == os.path.join(str(tmp_path), "async", "t") and got["latest"] == "t"
        sync, background = got["files"]
        assert sorted(sync) == sorted(background), rank
        for key, value in sync.items():
            assert torch.equal(value, background[key]), f"rank {rank}: {key}"
        assert got["peak"] >= got["staged"] > 0 and got["live"] == 0, got


def _fails_half_way(root: str) -> dict:
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(2))
    _step(engine, 0)
    engine.save_checkpoint(root, tag="good")
    if rank == 1:  # the disk fills half-way through this rank's file
        real = io.save_rank_state

        def half_then_full(directory, r, state, global_rank=None):
            with open(os.path.join(directory, io.rank_file(r)), "wb") as f:
                f.write(b"\0" * 1000)
            raise OSError(28, f"rank {global_rank} could not write checkpoint file "
                              f"{os.path.join(directory, io.rank_file(r))}: No space left on device")
        io.save_rank_state = half_then_full
    engine.save_checkpoint(root, tag="bad", async_save=True)
    try:
        for k in range(1, 40):
            try:
                _step(engine, k)
            except RuntimeError as err:
                return {"step": k, "error": str(err)}
            time.sleep(0.05)
        return {"step": None, "error": None}
    finally:
        if rank == 1:
            io.save_rank_state = real


def test_a_failed_background_write_is_raised_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = run_distributed(_fails_half_way, 2, root)
    assert ranks[0]["step"] is not None and ranks[0]["step"] == ranks[1]["step"], ranks
    for got in ranks:
        assert "asynchronous checkpoint" in got["error"] and "bad was not saved" in got["error"], got
        assert "rank 1" in got["error"] and "No space left on device" in got["error"], got
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "good"
    assert sorted(os.listdir(root)) == ["good", "latest"]


def test_the_budget_predicts_the_staged_copy():
    """``zeroplus.async_save`` in the config: the predicted copies of a save are the whole rank state (masters
    and Adam's two states in fp32: 12 bytes per owned element, plus the rest of the file), where a synchronous
    save streams its file and copies little."""
    budgets = {}
    for background in (False, True):
        cfg = dict(_config(2), zeroplus={"async_save": background})
        budgets[background] = zeroplus.estimate(ParityNet(), cfg, world_size=2, example_inputs=make_batches(2, 2)[0])
    owned = sum(p.numel() for p in ParityNet().parameters() if p.requires_grad) // 2
    assert budgets[True].checkpoint_copies - budgets[False].checkpoint_copies >= 12 * owned, budgets
