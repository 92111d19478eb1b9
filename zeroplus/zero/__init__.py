"""ZeRO partitioning: units, flat groups, gradient reduction, stage-3 gathering, the sharded step."""
from .partition import ZeroPartition
from .sharded_step import ShardedStep, StepOutcome

__all__ = ["ShardedStep", "StepOutcome", "ZeroPartition"]
