"""Config blocks of the numeric formats a run trains in: DeepSpeed's ``"fp16"`` (loss scaling) and ``"bf16"`` (with
its ``bf16_optimizer_states`` and ``bf16_master_weights_and_grads``, served by ``zeroplus.optimizer_states`` and
``zeroplus.master_weights``: ``blocks.py``). Strict as every block (``blocks.Block``).
"""
from __future__ import annotations

from pydantic import Field

from .blocks import Auto, Block


class FP16Config(Block):
    ds_unimplemented = frozenset({"auto_cast", "fp16_master_weights_and_grads"})
    enabled: bool | Auto = False
    loss_scale: float = Field(0.0, ge=0, description="0 means dynamic loss scaling; >0 is a static scale.")
    initial_scale_power: int = Field(16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: int = Field(1000, ge=1, description="Overflow-free steps before the scale doubles.")
    hysteresis: int = Field(2, ge=1, description="Overflows tolerated before the scale halves.")
    consecutive_hysteresis: bool = Field(False, description="Refill hysteresis after every good step.")
    min_loss_scale: float = Field(1.0, gt=0, description="The dynamic scale never drops below this.")


class BF16Config(Block):
    ds_unimplemented = frozenset({"immediate_grad_update", "check_grad_overflow"})
    enabled: bool | Auto = False
    bf16_optimizer_states: bool = Field(
        False, description="Adam's and AdamW's two moments stored in bf16, rounded to nearest (as "
                           "zeroplus.optimizer_states with both bf16).")
    bf16_master_weights_and_grads: bool = Field(
        False, description="The master weights kept in bf16, the weights the model computes with (as "
                           "zeroplus.master_weights.dtype bf16; its rounding applies); gradients are reduced in bf16 "
                           "as in every bf16 run and, over micro-batches, accumulated in bf16 at every stage (stages "
                           "2-3 otherwise accumulate them in fp32).")
