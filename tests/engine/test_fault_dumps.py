"""When it goes wrong: an out-of-memory error leaves the rank's memory state in a file.

In one process, at ZeRO-3, a model whose second block asks the CPU allocator for 128 TiB in its forward (a
real allocation failure, not a raised stand-in) trains under the engine: the ``RuntimeError`` keeps its type
and message, gains a note naming a file in ``zeroplus.dump_dir``, and the file says the engine was in its
forward computing unit ``blocks.1``, lists the ledger's live and peak bytes per category (both blocks' 576 bytes
of parameters, gathered: at one rank the shard is the whole) and every thread's Python stack. (A timed-out
collective's file: ``tests/engine/test_hangs.py``.)
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zeroplus


class _Block(nn.Module):
    def __init__(self, greedy: bool) -> None:
        super().__init__()
        self.layer, self.greedy = nn.Linear(8, 8), greedy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            torch.empty(2 ** 45)  # 128 TiB
        return self.layer(x)


class _Greedy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(False), _Block(True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


@pytest.mark.fast
def test_out_of_memory_in_forward_writes_the_ledger_and_the_stacks_and_keeps_the_error(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "dump_dir": str(tmp_path)}}
    engine = zeroplus.initialize(_Greedy(), cfg)
    with pytest.raises(RuntimeError, match="can't allocate memory") as caught:
        engine(torch.randn(2, 8))
    notes = getattr(caught.value, "__notes__", [])
    assert notes and str(tmp_path) in notes[0], notes
    path = notes[0].split("written to ")[1].split(";")[0].strip()
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith("oom-rank0-")
    with open(path) as f:
        text = f.read()
    assert "engine phase: forward" in text and "can't allocate memory" in text, text[:400]
    assert "unit: blocks.1 " in text, text[:400]  # stage 3: the unit being computed
    gathered = [line for line in text.splitlines() if line.startswith("param_gathered ")]
    assert gathered and int(gathered[0].split()[1].replace(",", "")) == 4 * 2 * (8 * 8 + 8), text[:800]
    assert "Python stacks" in text and "test_fault_dumps.py" in text, text[-800:]
