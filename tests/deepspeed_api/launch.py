"""Launch a script on 2 gloo ranks through zeroplus's DeepSpeed API or through the real DeepSpeed.

``on_zeroplus``: ``zeroplus run --deepspeed-api -n 2 script args`` (the command a user types).
``on_zeroplus_nodes``: the same as several nodes on this host (``--nnodes``, ``--node-rank``).
``on_deepspeed``: torchrun with ``real_deepspeed.py`` in front of the script. Both with a fresh
rendezvous port, one OpenMP thread per rank, the CPU accelerator, and a time limit; a failure shows
the command and both ranks' output.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.dist_helper import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "deepspeed_api", "scripts")


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", ZEROPLUS_ACCELERATOR="cpu", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="warning")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited with {done.returncode}\n--- stdout\n{done.stdout[-6000:]}"
                             f"\n--- stderr\n{done.stderr[-12000:]}")
    return done


def on_zeroplus(script: str, args: list[str], nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "zeroplus.cli", "run", "--deepspeed-api", "-n", str(nproc),
                 f"--master-port={free_port()}", os.path.join(SCRIPTS, script), *args], timeout)


def on_zeroplus_nodes(script: str, args: list[str], nnodes: int = 2, nproc: int = 2, timeout: float = 600
                      ) -> list[subprocess.CompletedProcess]:
    """``zeroplus run --deepspeed-api --nnodes N --node-rank i -n P`` once per simulated node, all at once on this
    host (each launcher's ranks see ``LOCAL_WORLD_SIZE`` P, as on a node of their own); each launcher's output."""
    port = free_port()
    launches = [subprocess.Popen([sys.executable, "-m", "zeroplus.cli", "run", "--deepspeed-api", "-n", str(nproc),
                                  "--nnodes", str(nnodes), "--node-rank", str(i), "--master-addr", "127.0.0.1",
                                  f"--master-port={port}", os.path.join(SCRIPTS, script), *args],
                                 cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(nnodes)]
    done = []
    for i, launch in enumerate(launches):
        try:
            out, err = launch.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in launches:
                other.kill()
            raise
        if launch.returncode != 0:
            for other in launches:
                other.kill()
            raise AssertionError(f"node {i} of {nnodes} exited with {launch.returncode}\n--- stdout\n{out[-6000:]}"
                                 f"\n--- stderr\n{err[-12000:]}")
        done.append(subprocess.CompletedProcess(launch.args, 0, out, err))
    return done


def on_deepspeed(script: str, args: list[str], nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                 f"--master-port={free_port()}", "-m", "tests.deepspeed_api.real_deepspeed",
                 os.path.join(SCRIPTS, script), *args], timeout)


def hf_template(name: str, for_deepspeed_on_cpu: bool) -> dict:
    """``configs/NAME.json`` (a Hugging Face template, ``"auto"`` values left for the Trainer); for
    DeepSpeed on a CPU without optimizer offload (it would build its CPU Adam kernel) and with
    ``torch_adam``."""
    config = json.loads(pathlib.Path(ROOT, "configs", f"{name}.json").read_text())
    if for_deepspeed_on_cpu:
        config["zero_optimization"].pop("offload_optimizer", None)
        config["zero_optimization"].pop("offload_param", None)
        config["optimizer"]["params"]["torch_adam"] = True
    return config
