"""``zeroplus run``: launch N local ranks of a script through torchrun.

``zeroplus run -n 4 train.py --lr 1e-3`` runs ``python -m torch.distributed.run --nproc-per-node 4
train.py --lr 1e-3``. torchrun's own flags (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--rdzv-*``, ``--standalone``, ...) may stand before the script and pass through,
so multi-node launches work as torchrun's do. The script calls ``zeroplus.initialize``, which
initialises torch.distributed from the environment torchrun sets.

``zeroplus run --deepspeed-api -n 2 train.py --deepspeed ds.json`` runs a script written for
DeepSpeed unchanged: the launched processes import zeroplus's DeepSpeed API as ``deepspeed``
(``zeroplus/deepspeed_api/shim.py`` goes first on their ``PYTHONPATH``).
"""
from __future__ import annotations

import os
import subprocess
import sys

from .deepspeed_api.shim import environment_with_shim

DEEPSPEED_API_FLAG = "--deepspeed-api"
_BOOLEAN_FLAGS = {DEEPSPEED_API_FLAG, "--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path",
                  "--run_path"}


def split_run_args(argv: list[str]) -> tuple[int | None, list[str], list[str]]:
    """(nproc, torchrun flags, script and its args) from ``zeroplus run``'s arguments."""
    nproc: int | None = None
    flags: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-n", "--nproc-per-node", "--nproc_per_node"):
            if i + 1 >= len(argv):
                raise ValueError(f"{token} needs a number of processes")
            nproc = _positive(token, argv[i + 1])
            i += 2
        elif token.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            nproc = _positive("--nproc-per-node", token.split("=", 1)[1])
            i += 1
        elif token.startswith("-"):
            flags.append(token)
            takes_value = "=" not in token and token not in _BOOLEAN_FLAGS
            if takes_value and i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
            i += 1
        else:
            return nproc, flags, argv[i:]
    raise ValueError("zeroplus run needs a script to run, e.g. `zeroplus run -n 2 train.py`")


def _positive(flag: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{flag} must be a positive number of processes, got {value!r}")
    return int(value)


def torchrun_command(nproc: int, flags: list[str], program: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if not any(f.startswith(("--master-port", "--master_port", "--rdzv", "--nnodes", "--standalone")) for f in flags):
        cmd.append("--standalone")
    return cmd + flags + program


def run(argv: list[str]) -> int:
    nproc, flags, program = split_run_args(argv)
    deepspeed_api = DEEPSPEED_API_FLAG in flags
    flags = [f for f in flags if f != DEEPSPEED_API_FLAG]
    cmd = torchrun_command(nproc or 1, flags, program)
    env = environment_with_shim(dict(os.environ)) if deepspeed_api else dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc or 1))))
    return subprocess.call(cmd, env=env)
