"""``python -m zeroplus.deepspeed_api [-m module | script.py] args...``: run a DeepSpeed script unchanged on zeroplus.

For launchers zeroplus does not start itself: ``torchrun --nproc-per-node 2 -m zeroplus.deepspeed_api
train.py --deepspeed ds.json``, or the same line in a SLURM ``srun``. The shim directory goes first on
``PYTHONPATH`` (for the processes this one starts) and on ``sys.path`` (for this one), the alias is
installed, and the script runs as ``__main__`` with its own arguments, as ``python train.py`` would
run it.
"""
from __future__ import annotations

import os
import runpy
import sys

from .alias import install
from .shim import environment_with_shim, shim_dir


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    os.environ.update(environment_with_shim(dict(os.environ)))
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print("python -m zeroplus.deepspeed_api -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        sys.path[0:1] = [shim_dir(), os.getcwd()]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"python -m zeroplus.deepspeed_api: script {script!r} does not exist", file=sys.stderr)
        return 2
    sys.argv = argv
    sys.path[0:1] = [shim_dir(), os.path.dirname(os.path.abspath(script))]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
