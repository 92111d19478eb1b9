"""What a stage-3 parameter holds now, readable on the parameter itself (``p.ds_status``).

``AVAILABLE``: its values (gathered, or never partitioned); ``INFLIGHT``: its all-gather has started
and not landed (it still reads as released); ``NOT_AVAILABLE``: released, an empty tensor. Code
written for DeepSpeed asks this before reading a parameter directly (TRL's fused LM head gathers
``lm_head.weight`` with ``GatheredParameters`` unless it is ``AVAILABLE``); DeepSpeed's
``ZeroParamStatus`` is this enum. ``FlatParamGroup`` sets it where it gathers, exposes and releases.

At stage 3 every partitioned parameter also carries what DeepSpeed's do and what Transformers, PEFT and Accelerate
read to count or shape a parameter whose tensor is released (``label_whole``): ``ds_numel`` (the whole parameter's
element count: PEFT's ``get_nb_trainable_parameters``, the Trainer's ``get_model_param_count``), ``ds_shape`` (its
whole shape: PEFT's adapter layers size themselves by it) and ``ds_id`` (a number unique within the model).
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


def label_whole(params: list[tuple[torch.nn.Parameter, torch.Size]]) -> None:
    """Stage 3: give each parameter its whole ``ds_numel`` and ``ds_shape`` (``params``: each with its shape), and
    ``ds_id`` its index in ``params`` (see the module docstring)."""
    for index, (p, shape) in enumerate(params):
        p.ds_numel = shape.numel()  # type: ignore[attr-defined]
        p.ds_shape = torch.Size(shape)  # type: ignore[attr-defined]
        p.ds_id = index  # type: ignore[attr-defined]
