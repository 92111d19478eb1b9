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


def _failed(what: str, code: int, out: str, err: str) -> AssertionError:
    return AssertionError(f"{what} exited with {code}\n--- stdout\n{out[-6000:]}\n--- stderr\n{err[-12000:]}")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise _failed(" ".join(cmd), done.returncode, done.stdout, done.stderr)
    return done


def _zeroplus_run(nproc: int) -> list[str]:
    """The command a user types, up to its torchrun flags."""
    return [sys.executable, "-m", "zeroplus.cli", "run", "--deepspeed-api", "-n", str(nproc)]


def on_zeroplus(script: str, args: list[str], nproc: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    return _run([*_zeroplus_run(nproc), f"--master-port={free_port()}", os.path.join(SCRIPTS, script), *args],
                timeout)


def on_zeroplus_nodes(script: str, args: list[str], nnodes: int = 2, nproc: int = 2, timeout: float = 600
                      ) -> list[subprocess.CompletedProcess]:
    """``zeroplus run --deepspeed-api --nnodes N --node-rank i -n P`` once per simulated node, all at once on this
    host (each launcher's ranks see ``LOCAL_WORLD_SIZE`` P, as on a node of their own); each launcher's output."""
    port = free_port()
    launches = [subprocess.Popen([*_zeroplus_run(nproc), "--nnodes", str(nnodes), "--node-rank", str(i),
                                  "--master-addr", "127.0.0.1", f"--master-port={port}",
                                  os.path.join(SCRIPTS, script), *args],
                                 cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(nnodes)]
    done = []
    try:
        for i, launch in enumerate(launches):
            out, err = launch.communicate(timeout=timeout)
            if launch.returncode != 0:
                raise _failed(f"node {i} of {nnodes}", launch.returncode, out, err)
            done.append(subprocess.CompletedProcess(launch.args, 0, out, err))
    finally:
        for launch in launches:  # (after a failure or a timeout: the other nodes' launchers too)
            if launch.poll() is None:
                launch.kill()
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
