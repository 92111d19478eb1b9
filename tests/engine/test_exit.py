"""Leaving a script: collectives still in flight are finished before the interpreter tears down, also
when the script destroyed the process group itself. A gloo worker that finishes a collective during the
teardown must take the GIL to free the collective's tensors, and that request ends the thread inside a
destructor: the process aborts ("terminate called without an active exception", exit -6, about one
run in 30-200 of the CLI test before this was fixed)."""
from __future__ import annotations

import os
import subprocess
import sys
import weakref

import torch
import torch.distributed as dist

import zeroplus
from tests.dist_helper import free_port, run_distributed
from zeroplus.engine.exit_grace import EXIT_GRACE_SECONDS
from zeroplus.engine.lifecycle import wait_at_exit
from zeroplus.models import GPT, gpt_config


def _in_flight_after_destroy() -> tuple[int, int]:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "overlap_param_gather": True}}
    engine = zeroplus.initialize(GPT(gpt_config("tiny")), cfg)
    x = torch.randint(0, 256, (1, 16))
    engine.backward(engine(x, x))
    engine.step()  # issues the post-step all-gathers; with overlap_param_gather the next forward would wait
    dist.destroy_process_group()  # as many scripts end; the engine still holds the group
    before = sum(len(g.gathers) + len(g.gradient.pending) for g in engine.partition.groups)
    wait_at_exit(weakref.ref(engine))  # what the interpreter runs at exit
    return before, sum(len(g.gathers) + len(g.gradient.pending) for g in engine.partition.groups)


def test_exit_waits_for_collectives_in_flight_after_destroy_process_group():
    for before, after in run_distributed(_in_flight_after_destroy, 2):
        assert before > 0 and after == 0, (before, after)


_ENGINE_GONE_BEFORE_EXIT = """
import atexit, gc, time
import torch
import zeroplus
from zeroplus.models import GPT, gpt_config

atexit.register(lambda: print("teardown", time.monotonic(), flush=True))  # runs last: registered first
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}
engine = zeroplus.initialize(GPT(gpt_config("tiny")), cfg)
del engine  # as Hugging Face's Trainer leaves it before the script returns
gc.collect()
atexit.register(lambda: print("exit", time.monotonic(), flush=True))  # runs first
"""


def test_exit_gives_gloo_workers_the_gil_after_the_engine_is_gone():
    """The grace at exit runs once per process, between the script's own last atexit handler and the
    teardown, also when no engine is alive any more (before: it ran inside the engine's exit wait, which
    returned early for a freed engine, and the Trainer test aborted about once in 20 CI runs)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", ZEROPLUS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _ENGINE_GONE_BEFORE_EXIT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    times = dict(line.split() for line in done.stdout.splitlines() if line.startswith(("exit", "teardown")))
    assert float(times["teardown"]) - float(times["exit"]) >= EXIT_GRACE_SECONDS, times
