"""Model parallelism beside ZeRO: the process topology and its groups, tensor-parallel layers with
overlapped communication (``tensor_layers.py``, ``overlap.py``), pipeline stages and their schedule
(``pipeline.py``, ``pipeline_schedule.py``), and the mixture-of-experts layer (``moe.py``; stacked experts:
``grouped_experts.py``)."""
from .grouped_experts import GroupedFFN
from .groups import ParallelGroups, init_parallel, parallel_groups, reset_parallel
from .moe import MoE, TopKGate, is_expert
from .pipeline import PipelineModule
from .tensor_layers import (
                            ColumnParallelLinear,
                            RowParallelLinear,
                            SequenceParallelLayerNorm,
                            VocabParallelEmbedding,
                            is_tensor_parallel,
                            vocab_parallel_cross_entropy,
)
from .topology import Topology

__all__ = ["ColumnParallelLinear", "GroupedFFN", "MoE", "ParallelGroups", "PipelineModule", "RowParallelLinear",
           "TopKGate", "is_expert", "SequenceParallelLayerNorm", "Topology",
           "VocabParallelEmbedding", "init_parallel", "is_tensor_parallel", "parallel_groups", "reset_parallel",
           "vocab_parallel_cross_entropy"]
