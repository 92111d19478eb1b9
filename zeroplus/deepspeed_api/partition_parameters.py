"""``deepspeed.runtime.zero.partition_parameters``: ``Init`` with DeepSpeed's signature, and the names
callers reach into.

``Init`` is ``zeroplus.Init``; DeepSpeed's keyword arguments naming features zeroplus lacks
(quantized weights, a separate parameter-parallel or sequence-data-parallel group, a parameter
swapper) are accepted at their defaults and refused otherwise. One difference, by design: DeepSpeed
casts parameters to the config's fp16/bf16 while building; zeroplus keeps the dtype the model is
built in unless ``dtype=`` says otherwise, so fp32 master weights start from the exact initial values.

Transformers swaps ``zero_wrapper_for_fp_tensor_constructor`` while it builds a model under ZeRO-3,
so that DeepSpeed's ``Init`` does not retype ``torch.arange``. zeroplus's ``Init`` never retypes
tensor constructors, so the function here is never called: it exists to be swapped and restored.
``ZeroParamStatus`` is ``zeroplus/zero/param_status.py``'s enum: each engine parameter's ``ds_status``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from zeroplus.zero.construction import Init as ZeroplusInit
from zeroplus.zero.gathered import GatheredParameters
from zeroplus.zero.param_status import ParamStatus as ZeroParamStatus

from .accelerator import get_accelerator
from .unsupported import module_getattr, refuse

__getattr__ = module_getattr("deepspeed.runtime.zero.partition_parameters")
_orig_torch_arange = torch.arange
_UNSERVED_INIT_ARGUMENTS = ("zero_param_parallel_group", "zero_quantized_weights",
                            "zero_quantized_nontrainable_weights", "sequence_data_parallel_group", "param_swapper")


class Init(ZeroplusInit):
    """``deepspeed.zero.Init``: ``zeroplus.Init`` with DeepSpeed's full signature."""

    def __init__(self, module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
                 remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
                 config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None,
                 **deepspeed_only: Any) -> None:
        for name in _UNSERVED_INIT_ARGUMENTS:
            if deepspeed_only.pop(name, None) not in (None, False):
                refuse(f"deepspeed.zero.Init({name}=...)")
        if deepspeed_only:
            refuse(f"deepspeed.zero.Init({', '.join(sorted(deepspeed_only))}=...)")
        super().__init__(module=module, data_parallel_group=data_parallel_group,
                         mem_efficient_linear=mem_efficient_linear, remote_device=remote_device,
                         pin_memory=pin_memory, config_dict_or_path=config_dict_or_path, config=config,
                         enabled=enabled, dtype=dtype, mpu=mpu)


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: Any = None,
                                           **kwargs: Any) -> Callable[..., Any]:
    """Returns ``fn`` unchanged: zeroplus's ``Init`` keeps tensor constructors as they are."""
    return fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "zero_wrapper_for_fp_tensor_constructor"]
