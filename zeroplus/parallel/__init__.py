"""Model parallelism beside ZeRO: the process topology and its groups, tensor-parallel layers with
overlapped communication (``tensor_layers.py``, ``overlap.py``)."""
from .groups import ParallelGroups, init_parallel, parallel_groups, reset_parallel
from .tensor_layers import (ColumnParallelLinear, RowParallelLinear, SequenceParallelLayerNorm,
                            VocabParallelEmbedding, is_tensor_parallel, vocab_parallel_cross_entropy)
from .topology import Topology

__all__ = ["ColumnParallelLinear", "ParallelGroups", "RowParallelLinear", "SequenceParallelLayerNorm", "Topology",
           "VocabParallelEmbedding", "init_parallel", "is_tensor_parallel", "parallel_groups", "reset_parallel",
           "vocab_parallel_cross_entropy"]
