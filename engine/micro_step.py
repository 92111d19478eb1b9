"""Where the engine is in a micro-step and in its life: the states its calls move through, in one place.

``MicroStep`` says what the backwards since the last ``step()`` did; it only rises until ``step()`` sets it
back to ``IDLE`` (``raised``), so the order is the meaning:

- ``IDLE``: no backward since the last ``step()`` (``step()`` refuses: there is no gradient). Gradient
  memory: the reduced shards of an accumulation in progress (stages 2-3 accumulate in fp32 shards, stages
  0-1 in the flat compute-dtype buffers), nothing else.
- ``BACKWARD``: backwards ran, none of them synced: inside ``no_sync()``, or a pipeline chunk's backward
  (``backward_stage``). The flat gradient buffers hold the sum so far (stages 0-1); nothing was reduced.
- ``SYNCED``: a backward outside ``no_sync()`` ran before the accumulation boundary: at stages 2-3 its
  gradients were reduced into the shards and the flat buffers freed; a second one before ``step()`` is a
  forgotten ``step()`` (``backward()`` refuses it, counting micro-steps itself).
- ``REDUCED``: a backward at the boundary reduced the accumulated gradients (every stage): ``step()`` will
  apply them. With the boundary set from outside (Accelerate), backwards may follow each other until this.

``Life``: ``LIVE`` until ``destroy()`` gives the model back (``DESTROYED``: hooks removed, stage 3 gathered
into the model; every training call refuses). Memory: two small integers.

See note: explicit state (docs/design-notes.md).
"""
from __future__ import annotations

import enum


class MicroStep(enum.IntEnum):
    IDLE = 0
    BACKWARD = 1
    SYNCED = 2
    REDUCED = 3

    def raised(self, to: MicroStep) -> MicroStep:
        """The state after a backward that reached ``to`` (never lower than now)."""
        return max(self, to)


class Life(enum.Enum):
    LIVE = "live"
    DESTROYED = "destroyed"
