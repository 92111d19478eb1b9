"""DeepSpeed as the CPU reference, without the op it would compile and never use here.

DeepSpeed's communication backend on its CPU accelerator loads ``deepspeed_shm_comm``, a shared-memory
all-reduce for inference (``inference_all_reduce``), compiling it on first use in every fresh install:
about a minute on 2 cores. ZeRO training does not call it. DeepSpeed keeps its table of compatible
ops in ``deepspeed.ops.__compatible_ops__`` (computed on first access, edits kept); the references
here mark that op incompatible before DeepSpeed starts, so it is neither compiled nor loaded.
"""
from __future__ import annotations

from typing import Any


def deepspeed_reference() -> Any:
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return deepspeed
