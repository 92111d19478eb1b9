"""Leaving a script: collectives still in flight are finished before the interpreter tears down, also
when the script destroyed the process group itself. A gloo worker that finishes a collective during the
teardown must take the GIL to free the collective's tensors, and that request ends the thread inside a
destructor: the process aborts ("terminate called without an active exception", exit -6, about one
run in 30-200 of the CLI test before this was fixed)."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

import zeroplus
from engine.engine import _wait_at_exit
from tests.dist_helper import run_distributed
from zeroplus.models import GPT, gpt_config


def _in_flight_after_destroy() -> tuple[int, int]:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(GPT(gpt_config("tiny")), cfg)
    x = torch.randint(0, 256, (1, 16))
    engine.backward(engine(x, x))
    engine.step()  # issues the post-step all-gathers; the next forward would wait for them
    dist.destroy_process_group()  # as many scripts end; the engine still holds the group
    before = sum(len(g.pending) for g in engine.partition.groups)
    _wait_at_exit(weakref.ref(engine))  # what the interpreter runs at exit
    return before, sum(len(g.pending) for g in engine.partition.groups)


def test_exit_waits_for_collectives_in_flight_after_destroy_process_group():
    for before, after in run_distributed(_in_flight_after_destroy, 2):
        assert before > 0 and after == 0, (before, after)
