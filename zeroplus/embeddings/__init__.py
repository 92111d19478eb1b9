"""Embedding tables larger than a rank (DLRM-style): table-, row- and column-wise sharding over the
data-parallel ranks, lookups routed by all-to-all, row-sparse optimizers, a per-table sharding planner
(``tables.py``, ``collection.py``, ``sparse_optim.py``, ``planner.py``)."""
from .collection import EmbeddingBagCollection
from .planner import TablePlan, TablePlanError, plan_tables
from .sparse_optim import SparseOptimConfig
from .tables import TableConfig

__all__ = ["EmbeddingBagCollection", "SparseOptimConfig", "TableConfig", "TablePlan", "TablePlanError", "plan_tables"]
