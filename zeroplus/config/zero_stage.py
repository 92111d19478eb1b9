"""The ZeRO stage as a policy: what each stage shards over the data-parallel ranks.

``ZeroStage`` is an ``IntEnum`` so that a config's ``"stage": 3`` and every comparison a user writes keep
working, but zeroplus itself asks the stage what it does (``stage.shards_gradients``), never compares its
number. Bytes per rank for a model of P parameters on N data-parallel ranks, compute dtype of c bytes,
fp32 master and Adam's two fp32 states (12 bytes), before activations and buffers in flight:

=====  ================  ====================================  ==================
stage  name              shards                                bytes per rank
=====  ================  ====================================  ==================
0      ``NONE``          nothing: every rank steps everything   (2c + 12) P
1      ``OPTIMIZER``     master and optimizer states            2c P + 12 P / N
2      ``GRADIENTS``     + the reduced gradients                c P + (c + 12) P / N
3      ``PARAMETERS``    + the parameters (gathered per use)    (2c + 12) P / N
=====  ================  ====================================  ==================

(c P of gradients is held while a group reduces at stages 2-3, one group at a time; ``zero/flat_group.py``
has the per-group table.)

See note: explicit state (docs/design-notes.md).
"""
from __future__ import annotations

import enum


class ZeroStage(enum.IntEnum):
    """What a ZeRO stage partitions (see the table above)."""

    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3

    @property
    def partitions(self) -> bool:
        """Stages 1-3: each rank owns a shard of every flat group (stage 0 owns the whole group)."""
        return self is not ZeroStage.NONE

    @property
    def shards_gradients(self) -> bool:
        """Stages 2-3: every gradient is reduced as soon as its group is complete, to this rank's shard (stage 1
        keeps the whole gradient until the accumulation boundary)."""
        return self >= ZeroStage.GRADIENTS

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: a unit's parameters are held as shards and gathered around each use."""
        return self is ZeroStage.PARAMETERS

    @property
    def gathers_after_step(self) -> bool:
        """Stages 1-2: the stepped shards are all-gathered into the whole parameters after each step (stage 0
        stepped them whole; stage 3 gathers at the next use)."""
        return self in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS)
