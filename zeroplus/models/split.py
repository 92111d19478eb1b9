"""The built-in GPT as one rank of a tensor x pipeline x expert topology builds it.

    model = split_gpt(GPT(gpt_config("medium")), sequence_parallel=True)   # after init_parallel

With tensor > 1 the tensor-parallel form (``gpt_tp.py``: heads, MLP width and vocabulary split); with
pipeline > 1 this rank's stage of its layers (``gpt_pipe.py``, the head untied from the token table when
they land on different stages) in a ``PipelineModule``; MoE blocks take their experts from the expert
group. The groups are whatever ``parallel_groups()`` answers: real ones after ``init_parallel``, the
estimate's stand-ins inside ``zeroplus.parallel.groups.using``. Memory: the whole GPT while it is
sliced (every rank starts from the same weights), then this rank's part.
"""
from __future__ import annotations

from torch import nn

from ..parallel.groups import parallel_groups
from ..parallel.pipeline import PipelineModule
from .gpt import GPT
from .gpt_pipe import gpt_pipeline_layers, gpt_pipeline_loss
from .gpt_tp import TensorParallelGPT, tensor_parallel_pipeline_layers


def split_gpt(gpt: GPT, *, sequence_parallel: bool = False, overlap_chunks: int = 1) -> nn.Module:
    """``gpt`` (built alike on every rank, e.g. from one seed) as this rank's part of it."""
    topology = parallel_groups().topology
    tp_model = None
    if topology.tensor > 1:  # (refuses MoE blocks: tensor-parallel experts are not built)
        tp_model = TensorParallelGPT.from_dense(gpt, sequence_parallel=sequence_parallel,
                                                overlap_chunks=overlap_chunks)
    if topology.pipeline == 1:
        return tp_model if tp_model is not None else gpt
    layers, loss_fn = (tensor_parallel_pipeline_layers(tp_model) if tp_model is not None
                       else (gpt_pipeline_layers(gpt), gpt_pipeline_loss))
    return PipelineModule(layers, loss_fn)


__all__ = ["split_gpt"]
