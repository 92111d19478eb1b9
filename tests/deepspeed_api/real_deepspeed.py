"""``python -m tests.deepspeed_api.real_deepspeed script.py args``: run a script on the real DeepSpeed (CPU).

The reference side of the unchanged-script tests: DeepSpeed's CPU accelerator is selected and its
inference-only shared-memory op is marked incompatible before the script imports DeepSpeed
(``tests/deepspeed_parity/ds_cpu.py``: it would compile for a minute and never be used), then the
script runs as ``__main__`` with its arguments. When it returns, the process ends at once
(``os._exit``, after flushing): DeepSpeed leaves gloo works whose worker threads may free their
tensors while the interpreter tears down, and the process then aborts ("terminate called without an
active exception", PyTorch PR 179291) after the script's work is done: seen in about one CI run in
five. A script that raises still exits through the interpreter, with its traceback.
"""
import os
import runpy
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
from tests.deepspeed_parity.ds_cpu import deepspeed_reference  # noqa: E402

if __name__ == "__main__":
    deepspeed_reference()
    script, *rest = sys.argv[1:]
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
