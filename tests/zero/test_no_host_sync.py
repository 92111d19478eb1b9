"""A default step reads nothing on the host: the clip coefficient and the overflow flag stay device tensors.

On a GPU a value read on the host (``item()``, ``bool()``) stalls it until the queue drains. With a loss scale that
never changes with an overflow (bf16, fp32, a static fp16 scale) and torch's fused AdamW (what an ``AdamW`` block
builds), the step hands the kernel ``grad_scale`` (``1 / coef``) and ``found_inf`` as tensors: it divides by the one
and, where the other is 1, leaves the parameters, the states and the step count as they were. What is reported
(``get_global_grad_norm()``, ``skipped_steps``, ``was_step_applied()``) is read when asked. Held here: a steady step
at stages 0-3 on 1 and 2 ranks runs no host read at dispatch (``_local_scalar_dense``, ``is_nonzero``, nor an op whose
output size depends on values: ``unique``, ``nonzero``, boolean indexing; an embedding's per-token sums are formed
in fixed sizes, ``use_grads.per_token_sums``); a step whose
gradients are not finite in fp32 and bf16 changes nothing, the learning-rate schedule steps on (the flag is not read
to decide it), and ``skipped_steps`` counts it, with the warning, when read. The values are the host path's bit for
bit (the parity tests run this path). See note: no host sync.
"""
from __future__ import annotations

import importlib.util
import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import ParityNet, make_batches


def _bench_worker():  # type: ignore[no-untyped-def]
    """The step census's module (``bench/bench_worker.py``): its ``reads_on_host`` says what counts as a read."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("bench_worker", os.path.join(root, "bench", "bench_worker.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reads_on_host = _bench_worker().reads_on_host


def _reader() -> str:
    """The innermost function of the library on the stack: who read."""
    for frame in reversed(traceback.extract_stack()):
        if "/tests/" not in frame.filename and ("zeroplus" in frame.filename or "/engine/" in frame.filename):
            return f"{os.path.basename(frame.filename)}:{frame.name}"
    return "?"


class HostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if reads_on_host(func, args):
            self.reads.append(_reader())
        return func(*args, **(kwargs or {}))


def _config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _reads_in_steady_steps(rows: bool | None = None) -> dict:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        config = _config(stage, "fp32")
        config["zeroplus"]["embedding_rows"] = rows
        engine = zeroplus.initialize(ParityNet(), config)
        batches = make_batches(4 * world, 2)
        for step in range(4):
            x, y = batches[step * world + rank]
            loss = engine(x, y)
            mode = HostReads()
            with mode:
                engine.backward(loss)
                engine.step()
            if step >= 2:  # steady: the first steps make the states
                out[f"stage {stage} step {step}"] = mode.reads
        out[f"stage {stage} norm"] = engine.get_global_grad_norm()  # read when asked
        engine.destroy()
    return out


# The one path that still reads: at stages 2-3 on several ranks an embedding whose rows are fewer bytes than its
# gradient (ParityNet's tied table) has them reduced sparsely (row_reduce.py), whose sizes depend on the tokens (how
# many rows each rank sends, which touch this shard). Whether any rank holds a dense gradient for the group after its
# early reduction is agreed once, in the first backward (grad_schedule.BackwardSchedule.late_uses), not read each step.
ROW_PATH = {"row_reduce.py:reduce_rows"}


@pytest.mark.parametrize("rows", [None, False], ids=["rows", "dense"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_default_step_reads_nothing_on_the_host(world, rows):
    """Without the embeddings' rows (``zeroplus.embedding_rows`` false, as an accelerator's defaults run where the
    memory is not needed) nothing at all is read."""
    for rank, result in enumerate(run_distributed(_reads_in_steady_steps, world, rows)):
        for where, reads in result.items():
            if where.endswith("norm"):
                assert isinstance(reads, float) and reads > 0, f"rank {rank} {where}: {reads}"
            elif world > 1 and where.split()[1] in ("2", "3") and rows is None:  # the tied embedding's row path
                assert reads and set(reads) <= ROW_PATH, f"rank {rank} {where}: {reads}"
            else:
                assert reads == [], f"rank {rank} {where}: {reads}"


def _overflow_run(dtype: str) -> dict:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), _config(stage, dtype))
        batches = make_batches(4 * world, 2)
        changed, applied = [], []
        for step in range(4):
            before = engine.consolidated_fp32_state()
            x, y = batches[step * world + rank]
            loss = engine(x, y)
            if step == 2 and rank == world - 1:
                loss = loss * float("inf")  # one rank's gradients are not finite: every rank skips
            engine.backward(loss)
            engine.step()
            after = engine.consolidated_fp32_state()
            changed.append(any(not torch.equal(before[n], after[n]) for n in before))
            applied.append(engine.was_step_applied())
        states = engine.optimizer.state.values()
        out[stage] = {"changed": changed, "applied": applied, "skipped": engine.skipped_steps,
                      "scheduler_steps": engine.lr_scheduler.last_batch_iteration + 1,
                      "step_counts": sorted({float(s["step"]) for s in states if "step" in s})}
        engine.destroy()
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_step_that_is_not_finite_changes_nothing_and_is_counted_when_read(dtype):
    results = run_distributed(_overflow_run, 2, dtype)
    for rank, result in enumerate(results):
        for stage, r in result.items():
            where = f"{dtype} stage {stage} rank {rank}: {r}"
            assert r["changed"] == [True, True, False, True], where
            assert r["applied"] == [True, True, False, True], where
            assert r["skipped"] == 1, where
            assert r["scheduler_steps"] == 4, where  # the schedule is not held back by a read of the flag
            assert r["step_counts"] in ([], [3.0]), where  # the kernel took the skipped step's count back
