"""What the parallel tests share: predicted model-state peaks equal the ledger's, byte for byte; each rank's slices;
a Hugging Face causal LM's training steps on an engine.

One allowance: on gloo the gradient reductions are in-place all-reduces of the flat gradient
(``grad_reducer.py``), and gloo's worker thread drops its reference to a finished one's buffer a
moment after ``wait()`` returns, so under load the measured gradient peak can be one group's flat
gradient higher than predicted (never lower)."""
from __future__ import annotations

from typing import Any

import torch

from zeroplus.ledger import Category

MODEL_STATES = ("param", "param_gathered", "master", "optim_state", "grad")


def hf_steps(engine: Any, batches: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """One optimizer step per batch of token ids (the model's own loss on ``labels=ids``): the losses and the
    global gradient norms."""
    losses, norms = [], []
    for ids in batches:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def local_params(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's parameter slices by name (its fp32 masters), whole over the data group (a collective)."""
    out = {}
    for g in engine.partition.groups:
        full = g.gather_master()
        for name, offset, shape in zip(g.names, g.offsets, g.shapes):
            out[name] = full[offset:offset + shape.numel()].view(shape).clone()
    return out


def ledger_peaks(engine: Any) -> dict[str, int]:
    """The ledger's peak per category, and ``largest_group_bytes``: the largest flat gradient."""
    peaks = {c.value: engine.ledger.peak_bytes(c) for c in Category}
    peaks["largest_group_bytes"] = max(g.padded_numel * g.full.element_size() for g in engine.partition.groups)
    return peaks


def assert_model_states_predicted(measured: dict[str, int], where: str, **predictions: dict[str, int]) -> None:
    """Each ``predictions`` entry (by who predicted: ``estimate=``, ``engine=``) equals ``measured`` per category."""
    for who, predicted in predictions.items():
        for category in MODEL_STATES:
            late = measured.get("largest_group_bytes", 0) if category == "grad" else 0
            assert predicted[category] <= measured[category] <= predicted[category] + late, \
                f"{where}: {category} predicted by {who} {predicted[category]}, measured {measured[category]}"
