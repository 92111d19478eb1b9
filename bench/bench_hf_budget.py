"""Accuracy of the memory budget in a user's process: zeroplus's GPT (``gpt``: the built-in GPT medium) and
five Hugging Face families at ZeRO 1-3, 1, 2 or 4 gloo ranks on CPU, two sequence lengths, fp32 and
bf16, with the model's Transformers classes imported before the measured start or not; the main job
(``zeroplus train``) and one Trainer run under the DeepSpeed API. Each row: the engine's own
first-forward prediction against the peak the engine's report measures (resident memory above the
process when ``initialize`` started, the model's tensors counted as the engine's: what the budget
predicts and every log prints), with the peak above the process before the model existed beside it.

    python bench/bench_hf_budget.py                       # 2 ranks, fp32, imported first, glibc returning memory
    python bench/bench_hf_budget.py --families gpt,llama --stages 3 --seqs 128 --nprocs 1,2,4 --dtypes fp32,bf16
    python bench/bench_hf_budget.py --families '' --main-job --trainer

``--allocator trim`` (default) runs with ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` at 128 KiB,
which is what the budget assumes (freed memory goes back to the system); ``default`` runs glibc as is.
bf16 rows belong only where the CPU computes bf16 natively (elsewhere it is slow: the script says so).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # tests.hf_models

from bench_zero import MALLOC_ENV  # noqa: E402

from tests.hf_models import FAMILIES  # noqa: E402

# the log's peak line: "memory peak 0.057 GiB, predicted 0.050 GiB in backward (-11.7%)"
PEAK_LINE = re.compile(r"memory peak ([0-9.]+) GiB, predicted ([0-9.]+) GiB in \w+ \(([-+0-9.]+)%\)")


def _env(allocator: str) -> dict[str, str]:
    env = dict(os.environ, ZEROPLUS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key in MALLOC_ENV:
        env.pop(key, None)
    if allocator == "trim":
        env.update(MALLOC_ENV)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def run(family: str, stage: int, seq: int, allocator: str, nproc: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "result")
        size = ["--size", "medium"] if family == "gpt" else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               os.path.join(HERE, "bench_hf_worker.py"), "--family", family, "--stage", str(stage),
               "--seq", str(seq), "--out-prefix", prefix, *size, *extra]
        proc = subprocess.run(cmd, env=_env(allocator), capture_output=True, text=True)
        out = []
        for rank in range(nproc):
            path = f"{prefix}.{rank}.json"
            if not os.path.exists(path):
                raise RuntimeError(f"{family} stage {stage} seq {seq} failed:\n{proc.stdout[-2000:]}\n"
                                   f"{proc.stderr[-3000:]}")
            with open(path) as f:
                out.append(json.load(f))
        return out


def _logged_error(cmd: list[str], allocator: str, what: str) -> dict:
    """Run ``cmd`` and read rank 0's peak line (the first one it logs)."""
    proc = subprocess.run(cmd, env=_env(allocator), capture_output=True, text=True, cwd=ROOT)
    found = PEAK_LINE.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    measured, predicted, error = (float(g) for g in found.groups())
    return {"measured_mib": measured * 1024, "predicted_mib": predicted * 1024, "error_pct": error}


def main_job(allocator: str, steps: int) -> dict:
    """``zeroplus train`` (GPT small, its default bf16 or fp32 ZeRO-3 config, 2 ranks) with ``steps_per_print``
    at its config's 50: the line it logs at step 50."""
    return _logged_error([sys.executable, "-m", "zeroplus.cli", "train", "--steps", str(steps), "--save-dir", ""],
                         allocator, "the main job")


def trainer_run(allocator: str) -> dict:
    """The Hugging Face Trainer (a tiny Llama, the ZeRO-3 template, 2 ranks) through zeroplus's DeepSpeed API:
    the line logged after its first optimizer step."""
    with tempfile.TemporaryDirectory() as tmp:
        config = json.load(open(os.path.join(ROOT, "configs", "hf_zero3_template.json")))
        path = os.path.join(tmp, "ds.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return _logged_error([sys.executable, "-m", "zeroplus.cli", "run", "--deepspeed-api", "-n", "2",
                              os.path.join(ROOT, "tests", "deepspeed_api", "scripts", "hf_trainer.py"),
                              "--deepspeed", path, "--output_dir", os.path.join(tmp, "out"),
                              "--out", os.path.join(tmp, "r.json"), "--no-resume"], allocator, "the Trainer run")


def _native_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(("gpt", *FAMILIES)))
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--seqs", default="128,512")
    p.add_argument("--nprocs", default="2")
    p.add_argument("--dtypes", default="fp32")
    p.add_argument("--imports", default="first", help="first, after or both: the model's classes imported "
                                                      "before the measured start, or not")
    p.add_argument("--allocator", choices=["trim", "default"], default="trim")
    p.add_argument("--mask", action="store_true")
    p.add_argument("--main-job", action="store_true", help="add the main job's row (zeroplus train)")
    p.add_argument("--main-job-steps", type=int, default=50)
    p.add_argument("--trainer", action="store_true", help="add a Trainer run under the DeepSpeed API")
    p.add_argument("--json")
    args = p.parse_args()
    dtypes = args.dtypes.split(",")
    if "bf16" in dtypes and not _native_bf16():
        print("this CPU emulates bf16 (no avx512_bf16/amx): bf16 rows are slow and not what the budget is for")
    imports = {"first": [True], "after": [False], "both": [True, False]}[args.imports]
    rows = []
    state = "glibc returning freed memory" if args.allocator == "trim" else "glibc as is"
    print(f"allocator: {args.allocator} ({state})")
    print(f"{'family':<9}{'stage':>6}{'seq':>5}{'ranks':>6}{'dtype':>6}{'import':>7}{'rank':>5}{'predicted MiB':>15}"
          f"{'measured MiB':>14}{'error':>9}{'above pre-model':>17}")
    for family in [f for f in args.families.split(",") if f]:
        for stage in map(int, args.stages.split(",")):
            for seq in map(int, args.seqs.split(",")):
                for nproc in map(int, args.nprocs.split(",")):
                    for dtype in dtypes:
                        for first in imports if family != "gpt" else [False]:
                            extra = (["--bf16"] if dtype == "bf16" else []) + (["--mask"] if args.mask else []) + (
                                ["--import-first"] if first else [])
                            for r in run(family, stage, seq, args.allocator, nproc, extra):
                                label = (f"{family:<9}{stage:>6}{seq:>5}{nproc:>6}{dtype:>6}"
                                         f"{'first' if first else 'after':>7}{r['rank']:>5}")
                                if r["predicted"] is None:
                                    print(f"{label}  no prediction", flush=True)
                                    continue
                                measured = r["engine_measured"]
                                error = 100.0 * (r["predicted"] - measured) / measured
                                rows.append(dict(r, family=family, stage=stage, seq=seq, nproc=nproc, dtype=dtype,
                                                 import_first=first, error_pct=error))
                                print(f"{label}{r['predicted'] / 2**20:>15.1f}{measured / 2**20:>14.1f}"
                                      f"{error:>+8.1f}%{r['peak_above_start_bytes'] / 2**20:>17.1f}", flush=True)
    if args.main_job:
        r = main_job(args.allocator, args.main_job_steps)
        rows.append(dict(r, family="main job"))
        print(f"{'main job: zeroplus train, step ' + str(args.main_job_steps):<49}{r['predicted_mib']:>15.1f}"
              f"{r['measured_mib']:>14.1f}{r['error_pct']:>+8.1f}%", flush=True)
    if args.trainer:
        r = trainer_run(args.allocator)
        rows.append(dict(r, family="trainer"))
        print(f"{'Trainer (DeepSpeed API), first step':<49}{r['predicted_mib']:>15.1f}{r['measured_mib']:>14.1f}"
              f"{r['error_pct']:>+8.1f}%", flush=True)
    errors = [abs(r["error_pct"]) for r in rows]
    if errors:
        print(f"\n{len(rows)} predictions ({args.allocator} allocator): median |error| "
              f"{statistics.median(errors):.1f}%, largest {max(errors):.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
