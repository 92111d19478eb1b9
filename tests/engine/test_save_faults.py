"""Saving under faults: a full disk on one rank, a killed re-save of a tag, leftovers, a bad client state;
and what a skipped step says.

- Full disk (2 ranks; rank 1's file size limited with RLIMIT_FSIZE, as a full disk refuses writes): every
  rank raises, naming rank 1 and its file; ``latest`` still names the previous checkpoint, which loads;
  no temporary directory is left; the next save, with room again, works.
- Re-saving an existing tag swaps the directories atomically: a process killed right after the swap
  leaves the tag complete (the new one), and the old copy is removed by the next save.
- Leftovers of killed saves (hidden ``.TAG.tmp-*`` directories, ``.latest.tmp-*`` files) are removed by
  the next save.
- A client state holding an object that loading would refuse is refused at save, naming it.
- A skipped step in fp32 (a NaN loss) is a warning that says the gradients were not finite and no loss
  scale applies; the weights stay as they were.
"""
from __future__ import annotations

import logging
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train


def _config(stage: int = 2) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "error", "memory_estimate": False}}


def _saved_then_trained(path: str, tag: str):
    """An engine that trained a step, saved ``tag``, and trained another step."""
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config())
    batches = make_batches(4 * world, 2)
    engine_train(engine, batches, 1, rank, world, 1)
    engine.save_checkpoint(path, tag=tag)
    engine_train(engine, batches, 1, rank, world, 1, start=1)
    return engine, rank


def _full_disk(path: str) -> dict:
    engine, rank = _saved_then_trained(path, "first")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        engine.save_checkpoint(path, tag="second")
        error = None
    except (OSError, RuntimeError) as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    dist.barrier()
    left = sorted(os.listdir(path))
    with open(os.path.join(path, "latest")) as f:
        latest = f.read()
    dist.barrier()
    engine.save_checkpoint(path, tag="third")
    return {"error": error, "left": left, "latest": latest}


def test_full_disk_on_one_rank_fails_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_distributed(_full_disk, 2, path)
    broken = os.path.join(path, ".second.tmp-")
    for rank, result in enumerate(results):
        assert result["error"] is not None and "rank 1 could not write checkpoint file" in result["error"] \
            and broken in result["error"] and "rank00001.pt" in result["error"] \
            and "File too large" in result["error"], \
            f"rank {rank}: {result['error']}"
        assert result["left"] == ["first", "latest"] and result["latest"] == "first", result
    assert sorted(os.listdir(path)) == ["first", "latest", "third"]


def _resave_killed(path: str) -> None:
    engine, rank = _saved_then_trained(path, "t")
    if rank == 0:
        os.environ["ZEROPLUS_CHECKPOINT_FAULT"] = "after_exchange"
    engine.save_checkpoint(path, tag="t")


def test_resaving_a_tag_is_atomic(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError, match="died with exit code 17|failed"):
        run_distributed(_resave_killed, 2, path, timeout=120)
    assert zeroplus.load_fp32_state_dict(path, tag="t") is not None
    leftovers = [e for e in os.listdir(path) if e.startswith(".t.tmp-")]
    assert len(leftovers) == 1, os.listdir(path)  # the old copy, swapped out
    engine = zeroplus.initialize(ParityNet(), _config())
    engine.load_checkpoint(path, tag="t")
    assert engine.global_steps == 2  # the new save
    os.makedirs(os.path.join(path, ".x.tmp-abc"))
    open(os.path.join(path, ".latest.tmp-12345"), "w").close()
    engine.save_checkpoint(path, tag="t")  # re-save in place: swaps, and removes what was left
    assert sorted(os.listdir(path)) == ["latest", "t"]


class Opaque:
    pass


def test_client_state_that_would_not_load_is_refused_at_save(tmp_path):
    engine = zeroplus.initialize(ParityNet(), _config(1))
    engine_train(engine, make_batches(2, 2), 1, 0, 1, 1)
    with pytest.raises(TypeError, match=r"refused to save the client_state .*Opaque"):
        engine.save_checkpoint(str(tmp_path), client_state={"sampler": Opaque()})
    assert not os.path.exists(tmp_path / "latest")


def test_a_non_finite_step_in_fp32_is_a_warning_that_says_so():
    engine = zeroplus.initialize(ParityNet(), dict(_config(1), zeroplus={"log_level": "warning",
                                                                         "memory_estimate": False}))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("zeroplus.engine").addHandler(handler)
    try:
        before = engine.consolidated_fp32_state()
        x, y = make_batches(1, 2)[0]
        engine.backward(engine(x, y) * float("nan"))
        engine.step()
        skipped = engine.skipped_steps  # the kernel skipped it; reading the count warns (see note: no host sync)
    finally:
        logging.getLogger("zeroplus.engine").removeHandler(handler)
    assert skipped == 1
    after = engine.consolidated_fp32_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("gradients were not finite" in m and "float32 training" in m and "no loss scale" in m
               for m in warned), warned
