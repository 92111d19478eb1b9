"""The command line, as a user runs it: real subprocesses, real torchrun, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zeroplus.launcher import split_run_args

ENV = dict(os.environ, ZEROPLUS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")


def test_split_run_args_passes_torchrun_flags_through():
    assert split_run_args(["-n", "4", "train.py", "--lr", "1"]) == (4, [], ["train.py", "--lr", "1"])
    assert split_run_args(["--nnodes", "2", "--standalone", "-n", "2", "x.py"]) == \
        (2, ["--nnodes", "2", "--standalone"], ["x.py"])
    with pytest.raises(ValueError, match="needs a script"):
        split_run_args(["-n", "2"])
    with pytest.raises(ValueError, match="positive number of processes, got 'x'"):
        split_run_args(["-n", "x", "a.py"])


def test_zeroplus_run_launches_ranks_that_initialise_themselves(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import json, sys, torch, torch.distributed as dist, zeroplus
        from zeroplus.models import GPT, gpt_config
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3}, "zeroplus": {"log_level": "warning"}}
        engine = zeroplus.initialize(GPT(gpt_config("tiny")), cfg)   # no init_process_group here
        x = torch.randint(0, 256, (2, 16))
        for _ in range(2):
            engine.backward(engine(x, x)); engine.step()
        # one write per rank: print() writes text and newline separately, and two ranks interleave
        sys.stdout.write(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(),
                                     "steps": engine.global_steps}) + "\\n")
        sys.stdout.flush()
        dist.destroy_process_group()
    """))
    out = subprocess.run([sys.executable, "-m", "zeroplus.cli", "run", "-n", "2", str(script)], env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                   key=lambda d: d["rank"])
    assert [d["rank"] for d in lines] == [0, 1] and all(d["world"] == 2 and d["steps"] == 2 for d in lines)


def test_zeroplus_train_main_job_learns_and_resumes_under_context_parallelism(tmp_path):
    """The main job on 2 data-parallel ranks learns; resumed with ``--context 2`` (the checkpoint read into
    another layout) it goes on learning, and ``--profile`` writes each rank's trace."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 2000)
    save = tmp_path / "ckpt"
    args = [sys.executable, "-m", "zeroplus.cli", "train", "--size", "tiny", "--seq-len", "32", "--data", str(corpus),
            "--save-dir", str(save)]
    out = subprocess.run(args + ["--steps", "40"], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 40 and summary["final_loss"] < 4.6  # uniform over bytes: 5.55; measured 4.2
    assert "per-rank peak memory" in out.stdout
    split = [line for line in out.stdout.splitlines() if line.startswith("time per step (ms")]
    assert split and "fwd " in split[0] and "reduce wait" in split[0] and "MFU " in split[0], out.stdout[-2000:]
    assert out.stdout.count("\n  0 ") + out.stdout.count("\n  1 ") >= 2  # both ranks' rows
    assert (save / "latest").read_text() == "global_step40"
    traces = tmp_path / "profile"
    again = subprocess.run(args + ["--steps", "5", "--resume", "--context", "2", "--profile", str(traces)], env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 ranks = data 1 x context 2" in again.stdout and "resumed from" in again.stdout
    assert (save / "latest").read_text() == "global_step45"
    resumed = json.loads([line for line in again.stdout.splitlines() if line.startswith("{")][-1])
    assert resumed["steps"] == 5 and resumed["final_loss"] < 4.6, resumed  # measured 4.0
    written = sorted(f.name.split(".")[0] for f in traces.iterdir() if f.name.endswith(".pt.trace.json"))
    assert written == ["rank0", "rank1"], written  # --profile: each rank's torch.profiler trace


def test_zeroplus_train_dlrm_second_main_job_learns_and_resumes_resharded(tmp_path):
    save = tmp_path / "ckpt"
    args = [sys.executable, "-m", "zeroplus.cli", "train", "--model", "dlrm", "--max-rows", "5000", "--save-dir",
            str(save)]
    out = subprocess.run(args + ["--steps", "40"], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 40 and summary["final_loss"] < 0.6 and summary["held_out_loss"] < 0.6  # log 2: 0.69
    assert "26 tables" in out.stdout and "2 ranks, tables table-wise" in out.stdout  # the planner's choice
    assert out.stdout.count("\n  0 ") + out.stdout.count("\n  1 ") >= 2  # both ranks' memory rows
    assert (save / "latest").read_text() == "global_step40"
    again = subprocess.run(args + ["--steps", "5", "--resume", "--sharding", "row"], env=ENV, capture_output=True,
                           text=True, timeout=300)  # saved table-wise, loaded row-wise
    assert again.returncode == 0, again.stderr[-3000:]
    assert "tables row-wise" in again.stdout and "resumed from" in again.stdout
    assert (save / "latest").read_text() == "global_step45"
    assert json.loads([line for line in again.stdout.splitlines() if line.startswith("{")][-1])["held_out_loss"] < 0.6
