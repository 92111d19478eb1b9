"""No silent hangs: ranks that disagree fail at ``initialize``; a stalled rank ends the others in time.

- Disagreement (2 ranks, one spawn): rank 1 given another ZeRO stage, another accumulation, a model
  with a block fewer, a tensor of another size, another dtype, or a memory budget where rank 0 has none:
  every rank raises the same ``ConfigError`` at ``initialize`` naming the first difference (before, each
  hung or was filled in silently by the initial broadcast).
- A stall (zeroplus creates the process group from the launcher's environment, with
  ``zeroplus.collective_timeout`` 3 s): rank 1 stalls before its backward until rank 0 has ended (8 s at
  most); rank 0 raises a ``CollectiveError`` within the timeout plus the roll call, naming the collective
  and rank 1 as the rank that did not arrive.
- ``save_checkpoint`` / ``load_checkpoint`` called by rank 0 alone: rank 0 raises in time, naming the
  collective and rank 1.
- In each stall, rank 0's error names a file (``ZEROPLUS_DUMP_DIR``) saying what it was doing: the engine's
  phase, the collective and every thread's stack.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from zeroplus.collective_faults import ROLL_CALL_SECONDS, CollectiveError
from zeroplus.config import ConfigError

TIMEOUT_S = 3.0


def _config(stage: int = 2, gas: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
            "zeroplus": {"log_level": "error", "memory_estimate": False, "collective_timeout": TIMEOUT_S}}


def _wider() -> ParityNet:
    model = ParityNet()
    model.out_bias = torch.nn.Parameter(torch.zeros(40))
    return model


def _budgeted() -> dict:
    config = _config()
    config["zeroplus"].update(memory_budget="8GB", seq_len=8)
    return config


CASES = {  # name: (what rank 1 gets, the difference named)
    "stage": (lambda: (ParityNet(), _config(stage=3)), "zero_optimization.stage: 2 vs 3"),
    "accumulation": (lambda: (ParityNet(), _config(gas=2)), "gradient_accumulation_steps: 1 vs 2"),
    "blocks": (lambda: (ParityNet(n_blocks=2), _config()), "parameters: "),
    "shape": (lambda: (_wider(), _config()), "out_bias', [37], 'float32', True] vs ['out_bias', [40]"),
    "dtype": (lambda: (ParityNet().double(), _config()), "[37], 'float32', True] vs ['out_bias', [37], 'float64'"),
    # a budget's value may differ between ranks (each trains in the smallest), its presence may not
    "budget": (lambda: (ParityNet(), _budgeted()), "zeroplus.memory_budget: None vs 'set'"),
}


def _disagree() -> dict:
    rank, _ = rank_and_world()
    out = {}
    for name, (odd, _) in CASES.items():
        model, cfg = odd() if rank == 1 else (ParityNet(), _config())
        with pytest.raises(ConfigError) as caught:
            zeroplus.initialize(model, cfg)
        out[name] = str(caught.value)
    return out


def test_ranks_that_disagree_fail_at_initialize():
    for rank, errors in enumerate(run_distributed(_disagree, 2, timeout=120)):
        for name, (_, difference) in CASES.items():
            assert "rank 0 and rank 1 differ" in errors[name] and difference in errors[name], \
                f"{name}, rank {rank}: {errors[name]}"


def _stall(what: str, dumps: str) -> dict:
    os.environ["ZEROPLUS_DUMP_DIR"] = dumps
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config())  # creates the process group
    rank, world = rank_and_world()
    x, y = make_batches(world, 2)[rank]
    start = time.monotonic()
    done = os.path.join(dumps, "rank0-done")  # rank 1 stalls until rank 0 has ended (8 s at most)
    try:
        if what == "backward":
            loss = engine(x, y)
            if rank == 1:
                _stall_until(done, 8)
            engine.backward(loss)
            engine.step()
        elif rank == 0:  # rank 1 never calls it: it goes on with other work, then leaves
            engine.save_checkpoint("/tmp/zeroplus-unused") if what == "save" else engine.load_checkpoint("/nonexistent")
        else:
            _stall_until(done, 8)
        return {"error": None, "seconds": time.monotonic() - start}
    except (CollectiveError, ValueError, FileNotFoundError) as err:
        seconds = time.monotonic() - start
        dump = str(err).split("(phase, collective, stacks): ")[-1] if "(phase, collective" in str(err) else None
        text = open(dump).read() if dump and os.path.isfile(dump) else None
        return {"error": f"{type(err).__name__}: {err}", "seconds": seconds, "dump": text}
    finally:
        if rank == 0:
            open(done, "w").close()


def _stall_until(path: str, seconds: float) -> None:
    """Sleep until ``path`` exists or ``seconds`` have passed."""
    end = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


@pytest.mark.parametrize("what", ["backward", "save", "load"])
def test_a_stalled_rank_ends_the_others_in_time(what, tmp_path):
    rank0 = run_distributed(_stall, 2, what, str(tmp_path), init=False, timeout=120)[0]
    assert rank0["error"] is not None and rank0["error"].startswith("CollectiveError"), rank0
    assert "rank 1 did not arrive" in rank0["error"] and "collective timeout 3 s" in rank0["error"], rank0
    assert rank0["seconds"] < TIMEOUT_S + ROLL_CALL_SECONDS + 3, rank0
    # what rank 0 was doing, in the file the error names: its phase, the collective, its stacks
    dump = rank0["dump"]
    phase = {"backward": "backward", "save": "checkpoint save", "load": "checkpoint load"}[what]
    assert dump and f"engine phase: {phase}" in dump and "collective: " in dump and "Python stacks" in dump, dump
