"""The model's own ``F.cross_entropy`` calls, inside the engine's training forward, by blocks of rows.

A loss written in the model's forward (a user's GPT's ``F.cross_entropy(logits.view(-1, V), targets)``,
Hugging Face's ``ForCausalLMLoss``) keeps the log-softmax of the whole ``(tokens, vocabulary)`` logits for
backward and, in backward, makes two more of that size while it lives. While the engine's forward runs
with grad (``zeroplus.lean_cross_entropy``, on by default), a ``TorchFunctionMode`` hands each
``F.cross_entropy`` call that ``kernels/cross_entropy_rows.py`` computes (``supported``: floating
``(N, C)`` logits that need a gradient, class targets, no class weights or label smoothing) to
``cross_entropy_rows``; every other call, and every call while TorchDynamo traces, runs as written. So does a call
whose logits fit one block of rows (``block_rows``: on the CPU, up to 2^19 elements): there the blocked loss would
hold the logits, its gradient and a whole log-softmax and its gradient in backward, one logits' worth more than
torch's, and gain nothing in forward (see note: lean loss in one block).

Memory: at the loss's backward one logits' worth less, ``N C b`` bytes (32 MiB for 1024 tokens over a
16384 vocabulary in bf16), against two blocks of rows' temporaries more; in forward the log-softmax is never
whole. The loss and every gradient are bitwise the same (the kernel's test). Cost: one Python call per torch
function the forward calls; in backward a second log-softmax pass, by blocks (on this CPU the blocked loss is
faster than the reference: its blocks stay in cache). A loss computed outside the engine's forward (on the
logits it returns) is not reached: if the first training forward takes no call, the mode stands aside for the
rest of the run (``idle``, unless the model runs compiled), so a model that computes its loss outside pays
nothing per call; one that computes it after its blocks meets the mode only after the last block (``late``; see
note: idle modes). See note: lean loss (docs/design-notes.md).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..kernels.cross_entropy_rows import block_rows, cross_entropy_rows, supported
from .choices import TechniqueChoice
from .saved_tensors import storage_key

_SIGNATURE = inspect.signature(F.cross_entropy)


class LeanCrossEntropy(TorchFunctionMode):
    """Entered around each training forward of the engine (``SavedTensorRouter.forward``); counts the calls
    it took (``taken``). ``kept``: the storages of the logits the current forward's losses keep for backward
    (a model's output may be those logits: kept now until backward, whether or not the caller keeps the
    output, so the first forward's census counts them as saved)."""

    late = True  # a loss comes after the blocks: entered when the last one's forward ends (see note: idle modes)

    def __init__(self, choice: TechniqueChoice | None = None) -> None:
        super().__init__()
        self.taken = 0
        self.kept: set[int] = set()
        self._idle = False  # the first training forward took no call: not entered again (the router's to set)
        self.choice = choice  # the engine's: stood down (the run fits without it), it is idle from then on

    @property
    def idle(self) -> bool:
        return self._idle or (self.choice is not None and not self.choice.on)

    @idle.setter
    def idle(self, value: bool) -> None:
        self._idle = value

    def __enter__(self) -> LeanCrossEntropy:
        self.kept = set()
        return super().__enter__()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy and not torch.compiler.is_compiling():
            try:
                bound = _SIGNATURE.bind(*args, **kwargs)
            except TypeError:  # (torch's own call says what is wrong)
                return func(*args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            logits, targets = call.pop("input"), call.pop("target")
            if (torch.is_grad_enabled() and isinstance(logits, torch.Tensor) and logits.requires_grad
                    and supported(logits, targets, **call)
                    and block_rows(logits.shape[1], logits.shape[0], logits.device) < logits.shape[0]):
                self.taken += 1
                self.kept.add(storage_key(logits))
                return cross_entropy_rows(logits, targets, call["ignore_index"], call["reduction"])
        return func(*args, **kwargs)


__all__ = ["LeanCrossEntropy"]
