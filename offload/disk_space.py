"""Will the offloaded bytes fit? Checked at initialisation, so a full disk is an error before step 0.

Optimizer states are fp32, ``states_per_element(optimizer)`` tensors of the owned length (Adam:
2, exp_avg and exp_avg_sq; SGD with momentum: 1; ...), ``state_bytes_per_element`` bytes an owned element (an
optimizer that stores them in other dtypes says its own: ``optim/stored_states.py``). Parameter shards are
reserved file by file when they are written (``tier_tensor.py``); their total is checked here first.
"""
from __future__ import annotations

import shutil

import torch

_TWO = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
        torch.optim.Adadelta)


def states_per_element(optimizer: torch.optim.Optimizer) -> int:
    """fp32 state tensors the optimizer keeps per owned element (2 for an optimizer it does not know)."""
    d = optimizer.defaults
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if d.get("momentum", 0) else 0
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(d.get("momentum", 0)) + bool(d.get("centered", False))
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1
    if isinstance(optimizer, _TWO):
        return 2 + bool(d.get("amsgrad", False))
    return 2


def state_bytes_per_element(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of per-element state per owned element: the optimizer's own ``state_bytes`` where it has one (moments
    stored in other dtypes; fp8 moments' block scales as a fraction of a byte), else 4 per fp32 state tensor."""
    own = getattr(optimizer, "state_bytes", None)
    return float(own) if own is not None else 4 * states_per_element(optimizer)


def check_free_space(directory: str, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if needed > free:
        raise OSError(f"{directory} has {free / 2**30:.2f} GiB free, and this rank needs {needed / 2**30:.2f} GiB "
                      f"there ({needed} bytes)")
