"""The built-in GPT as one rank of a tensor x pipeline x expert topology builds it.

    model = split_gpt(gpt_config("medium", moe_experts=8), sequence_parallel=True)   # after init_parallel

With tensor > 1 the tensor-parallel form (``gpt_tp.py``: heads, MLP width and vocabulary split); with
pipeline > 1 this rank's stage of its layers (``gpt_pipe.py``, the head untied from the token table when
they land on different stages) in a ``PipelineModule``; MoE blocks take their experts from the expert
group. The groups are whatever ``parallel_groups()`` answers: real ones after ``init_parallel``, the
estimate's stand-ins inside ``zeroplus.parallel.groups.using``. Memory: this rank's slice only.
"""
from __future__ import annotations

from torch import nn

from ..parallel.groups import parallel_groups
from ..parallel.pipeline import PipelineModule
from .gpt import GPT, GPTConfig
from .gpt_pipe import gpt_pipeline_layers, gpt_pipeline_loss
from .gpt_tp import TensorParallelGPT, tensor_parallel_pipeline_layers


def split_gpt(cfg: GPTConfig, *, sequence_parallel: bool = False, overlap_chunks: int = 1) -> nn.Module:
    topology = parallel_groups().topology
    if topology.tensor > 1:
        if cfg.moe_experts:
            raise ValueError(f"GPT with {cfg.moe_experts} experts per block and tensor {topology.tensor}: "
                             f"tensor-parallel experts are not built (split experts with zeroplus.parallel.expert)")
        tp = TensorParallelGPT(cfg, sequence_parallel=sequence_parallel, overlap_chunks=overlap_chunks)
        if topology.pipeline == 1:
            return tp
        layers, loss_fn = tensor_parallel_pipeline_layers(tp)
        return PipelineModule(layers, loss_fn)
    gpt = GPT(cfg)
    return gpt if topology.pipeline == 1 else PipelineModule(gpt_pipeline_layers(gpt), gpt_pipeline_loss)


__all__ = ["split_gpt"]
