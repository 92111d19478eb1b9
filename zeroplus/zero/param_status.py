"""What a stage-3 parameter holds now, readable on the parameter itself (``p.ds_status``).

``AVAILABLE``: its values (gathered, or never partitioned); ``INFLIGHT``: its all-gather has started
and not landed (it still reads as released); ``NOT_AVAILABLE``: released, an empty tensor. Code
written for DeepSpeed asks this before reading a parameter directly (TRL's fused LM head gathers
``lm_head.weight`` with ``GatheredParameters`` unless it is ``AVAILABLE``); DeepSpeed's
``ZeroParamStatus`` is this enum. ``FlatParamGroup`` sets it where it gathers, exposes and releases.
"""
from __future__ import annotations

import enum

import torch

STATUS_ATTR = "ds_status"


class ParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def mark(params: list[torch.nn.Parameter], status: ParamStatus) -> None:
    for p in params:
        setattr(p, STATUS_ATTR, status)
