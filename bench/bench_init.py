"""Peak memory per rank while a model is built and initialised: zeroplus's four paths (a normal build, the
meta device, ``zeroplus.Init``, the meta device plus ``load_pretrained``) beside DeepSpeed's ``zero.Init``
and FSDP2's meta-device initialisation, on the same model, 2 and 4 gloo ranks, ZeRO-3, fp32.

    python bench/bench_init.py                                   # GPT 111M and HF Llama (small), 2 and 4 ranks
    python bench/bench_init.py --models gpt-111m --ranks 2

Peak: resident memory above the process before the model existed (after imports and the process group),
through ``initialize`` and the load, glibc returning freed memory. Target for the meta, Init and
pretrained paths: 1.1 x (this rank's model states after initialize + one unit gathered + the runtime's
construction overhead, ``budget/runtime_overhead.py``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from bench_init_worker import make  # noqa: E402
from bench_worker import rank_results  # noqa: E402
from bench_zero import MALLOC_ENV  # noqa: E402

from zeroplus.budget.runtime_overhead import runtime_bytes  # noqa: E402

ROWS = [("zeroplus", "normal"), ("zeroplus", "meta"), ("zeroplus", "init"), ("zeroplus", "pretrained"),
        ("deepspeed", "normal"), ("deepspeed", "init"), ("fsdp2", "normal"), ("fsdp2", "meta")]


def save_pretrained(model_name: str, folder: str) -> str:
    path = os.path.join(folder, model_name)
    torch.manual_seed(0)
    model = make(model_name)
    if model_name == "gpt-111m":
        os.makedirs(path)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        save_file(state, os.path.join(path, "model.safetensors"))
    else:
        model.save_pretrained(path, max_shard_size="100MB")
    return path


def run(framework: str, path: str, model: str, ranks: int, pretrained: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "r")
        env = dict(os.environ, ZEROPLUS_ACCELERATOR="cpu", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **MALLOC_ENV)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               os.path.join(HERE, "bench_init_worker.py"), "--framework", framework, "--path", path,
               "--model", model, "--pretrained", pretrained, "--out-prefix", prefix]
        return rank_results(prefix, ranks, f"{framework} {path} {model} x{ranks}",
                            subprocess.run(cmd, env=env, capture_output=True, text=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt-111m,llama-small")
    p.add_argument("--ranks", default="2,4")
    args = p.parse_args()
    runtime = runtime_bytes("cpu")[0]
    print(f"runtime overhead from construction (measured here): {runtime / 2**20:.1f} MiB")
    print(f"{'model':<12} {'ranks':>5}  {'framework':<10} {'path':<11} {'peak MiB':>9} {'target MiB':>11}")
    with tempfile.TemporaryDirectory() as folder:
        for model in args.models.split(","):
            checkpoint = save_pretrained(model, folder)
            for ranks in map(int, args.ranks.split(",")):
                for framework, path in ROWS:
                    try:
                        results = run(framework, path, model, ranks, checkpoint)
                    except RuntimeError as err:
                        print(f"{model:<12} {ranks:>5}  {framework:<10} {path:<11} failed: "
                              f"{str(err).splitlines()[-1][:80]}")
                        continue
                    peak = max(r["peak_above_start_bytes"] for r in results)
                    target = ""
                    if framework == "zeroplus" and path != "normal":
                        states = max(r["model_states_bytes"] + r["unit_bytes"] for r in results)
                        target = f"{1.1 * (states + runtime) / 2**20:.1f}"
                    print(f"{model:<12} {ranks:>5}  {framework:<10} {path:<11} {peak / 2**20:>9.1f} {target:>11}",
                          flush=True)


if __name__ == "__main__":
    main()
