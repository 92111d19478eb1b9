"""Embedding tables larger than a rank (DLRM-style): table-, row- and column-wise sharding over the
data-parallel ranks, lookups routed by all-to-all, row-sparse optimizers (``tables.py``, ``collection.py``,
``sparse_optim.py``)."""
from .collection import EmbeddingBagCollection
from .sparse_optim import SparseOptimConfig
from .tables import TableConfig

__all__ = ["EmbeddingBagCollection", "SparseOptimConfig", "TableConfig"]
