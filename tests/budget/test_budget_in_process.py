"""The budget in a user's process: the Hugging Face runs a user measured, in fresh processes
launched as a user launches them (torchrun, 2 gloo ranks, no ``MALLOC_*`` variables: glibc returns freed memory
because ``import zeroplus`` sets it so, see note: host allocator), a tiny Llama in place of the small one.

Each row: the engine's own first-forward prediction against the peak its report measures (above the
process when ``initialize`` started, the model's tensors counted). Importing the model's Transformers
classes before the measured start or not gives the same error, to 4 points (one configuration's measured peak
moves by up to 3 points between runs: 32.6-33.8 MiB at ZeRO-3, 4 x 256, since two gloo ranks reduce gradients by
exchanging rows, against 33.4-33.9 before, 2026-11-27; the gap between the two was 2 points at most); a process
that trained something before ``initialize`` is predicted without the first use it paid. The issue's table had
these +13% to +46% (the runtime overhead of another process added to one that had paid it).

Tolerance: the issue's 5% for its rows (measured -3.3% to +2.8% over three runs of this file on 2026-11-27).
On 2026-11-28 the ZeRO-3 4 x 256 launch measured +0.7% to +5.4% over 24 launches (at 8f454ab as well): the
tiny model's peak is 32 MiB, 22 MiB of it the process's runtime (torch's code paged in), and that moves by about
1 MiB (3 points) between launches of one configuration, so about one launch in ten ended just over 5%. A launch
outside the tolerance is launched once more, and the second launch decides: noise does not fail the test, a
prediction off by more than the tolerance fails both. A process that
trained before ``initialize``: 10% (+3.7% to +7.7%: what it paid is read, not the kernels' per-shape state).
On 2026-12-02 the ZeRO-2 1 x 512 and ZeRO-3 4 x 256 rows read -4.5% to -6.0% in full-suite runs and CI: the first
forward's simulation left reference cycles (1 MiB of tensors, 50,000 objects) that a process with Transformers
imported collects rarely, and a 1 MiB constant stood for what gloo holds for a peer (measured now: about 2 MiB).
With the prediction collecting its cycles and the probe's two ranks measuring the peer: -0.2% to +3.5% (ten launches).
The 15% this file stated before was set when these rows measured -5% to -14%, before the step's norm scratch
was sized to the gradient and torch's resident code was read (``budget/first_use.py``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroplus.budget.runtime_overhead import ALLOCATOR_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "bench", "bench_hf_worker.py")


def _errors(tmp_path, stage: int, micro: int, seq: int, import_first: bool, train_first: bool = False,
            tolerance: float = 0.0, attempt: int = 0) -> list[float]:
    """Each rank's error of one launch, in percent of its measured peak. ``tolerance``: launch once more if a rank
    is outside it (see the module's docstring), and return the second launch's errors."""
    prefix = str(tmp_path / f"r{stage}-{micro}-{seq}-{import_first}-{train_first}-{attempt}")
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_ENV}  # glibc as a user leaves it
    env.update(ZEROPLUS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", WORKER,
           "--family", "llama", "--size", "tiny", "--stage", str(stage), "--micro-batch", str(micro),
           "--seq", str(seq), "--steps", "2", "--out-prefix", prefix, *(["--import-first"] if import_first else []),
           *(["--train-first"] if train_first else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    errors = []
    for rank in range(2):
        path = f"{prefix}.{rank}.json"
        assert os.path.exists(path), done.stderr[-3000:]
        with open(path) as f:
            r = json.load(f)
        assert r["predicted"] is not None, "no prediction"
        errors.append(100.0 * (r["predicted"] - r["engine_measured"]) / r["engine_measured"])
    if tolerance and attempt == 0 and any(abs(e) > tolerance for e in errors):
        return _errors(tmp_path, stage, micro, seq, import_first, train_first, tolerance, attempt=1)
    return errors


TOLERANCE = 5.0  # percent; see the module's docstring
TRAINED_FIRST_TOLERANCE = 10.0
IMPORT_SPREAD = 4.0  # points: one configuration's own run-to-run spread is up to 3 (see the module's docstring)


@pytest.mark.parametrize("stage,micro,seq", [(1, 4, 512), (2, 1, 512)])
def test_the_issues_hugging_face_rows_are_within_the_stated_tolerance(tmp_path, stage, micro, seq):
    errors = _errors(tmp_path, stage, micro, seq, True, tolerance=TOLERANCE)
    assert all(abs(e) <= TOLERANCE for e in errors), errors


def test_importing_transformers_before_the_model_or_not_gives_the_same_error(tmp_path):
    first = _errors(tmp_path, 3, 4, 256, True, tolerance=TOLERANCE)
    after = _errors(tmp_path, 3, 4, 256, False, tolerance=TOLERANCE)
    assert all(abs(e) <= TOLERANCE for e in first + after), (first, after)
    assert all(abs(a - b) <= IMPORT_SPREAD for a, b in zip(first, after)), (first, after)


def test_a_process_that_trained_before_is_predicted_without_the_first_use_it_paid(tmp_path):
    """A script that trained (or evaluated) something before ``initialize`` has paid the kernels' first
    use: its peak above ``initialize`` is about half a fresh process's here, and the prediction follows
    (before the first-use measurement it was +70% over: the issue's Trainer row, +37%)."""
    errors = _errors(tmp_path, 1, 4, 512, True, train_first=True, tolerance=TRAINED_FIRST_TOLERANCE)
    assert all(abs(e) <= TRAINED_FIRST_TOLERANCE for e in errors), errors
