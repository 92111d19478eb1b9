"""What the config hands down to partitioning about offload, as small typed policies.

The engine's assembly (``engine/build.py``) reads ``zero_optimization.offload_optimizer`` and
``offload_param``, makes the tier, and passes one of these down; ``None`` means no offload. They carry
the tier object and the numbers the mechanisms need, nothing else.
"""
from __future__ import annotations

import dataclasses

from .tiers import Tier


@dataclasses.dataclass(frozen=True)
class OptimizerStateOffload:
    """Optimizer states on a lower tier, stepped through a window of sub-groups
    (``offload/optimizer_states.py``). Memory on the device: ``1 - ratio`` of the states plus
    ``buffer_count`` sub-groups in flight."""

    tier: Tier            # HostTier, FileTier, or the estimator's MetaTier
    sub_group_size: int   # elements per sub-group
    ratio: float          # fraction of each flat group's states kept on the tier
    buffer_count: int     # sub-groups read ahead / written back at once (the window)


@dataclasses.dataclass(frozen=True)
class ParamOffload:
    """Stage 3: each flat group's fp32 master shard (the parameter shard) kept on a tier
    (``zero/tiered_master.py``), read one unit ahead of each gather."""

    tier: Tier            # HostTier, FileTier, or the estimator's MetaTier
    max_writes: int       # write-backs in flight per shard (the next one waits for the oldest)


@dataclasses.dataclass(frozen=True)
class MasterPolicy:
    """How each flat group keeps its fp32 master shard (``zero/master_store.py``, ``zero/tiered_master.py``)."""

    shared: bool = False                 # bf16 halves plus 16-bit residuals (zeroplus.shared_master_weights)
    round_like_shared: bool = False      # a separate bf16 copy rounds ties away from zero, as shared storage does
    offload: ParamOffload | None = None  # stage 3: the shard kept on a tier (zero_optimization.offload_param)
    bf16_rounding: str | None = None     # bf16 masters (zeroplus.master_weights): their rounding; None: not bf16
    quantize_frozen: bool = False        # stage 3's frozen shards as int8 codes (zero_quantized_nontrainable_weights)
