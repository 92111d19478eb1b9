"""``deepspeed.ops.adam`` / ``adagrad`` / ``lamb``: DeepSpeed's optimizer classes as torch's and zeroplus's.

``DeepSpeedCPUAdam`` and ``FusedAdam`` are ``torch.optim.Adam`` (decoupled weight decay, i.e.
AdamW, unless ``adamw_mode``/``adam_w_mode`` is false); ``DeepSpeedCPUAdagrad`` is
``torch.optim.Adagrad``; ``FusedLamb`` is zeroplus's ``Lamb``. ``zeroplus.initialize`` adopts them as
client optimizers over the master shards, wherever those live (host or device), so the same class
serves both of DeepSpeed's kernels. DeepSpeed's kernel switches (``fp32_optimizer_states``,
``set_grad_none``) have no effect; ``bias_correction=False`` has no torch equivalent and is refused.
Lion is not built.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from zeroplus.optim.lamb import Lamb

from .unsupported import module_getattr, refuse

__getattr__ = module_getattr("deepspeed.ops")


class DeepSpeedCPUAdam(torch.optim.Adam):
    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if not bias_correction:
            refuse(f"{type(self).__name__}(bias_correction=False)", "torch's Adam always corrects the bias")
        super().__init__(model_params, lr=lr, betas=(betas[0], betas[1]), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=adamw_mode)


class FusedAdam(DeepSpeedCPUAdam):
    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    def __init__(self, model_params: Any, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            refuse("DeepSpeedCPUAdagrad(amsgrad=True)")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


class FusedLamb(Lamb):
    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if eps_inside_sqrt or amsgrad:
            refuse("FusedLamb(eps_inside_sqrt=True or amsgrad=True)")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,  # type: ignore[arg-type]
                         bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff)


adam = adagrad = lamb = sys.modules[__name__]  # deepspeed.ops.adam.DeepSpeedCPUAdam, by attribute too

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "FusedAdam", "FusedLamb"]
