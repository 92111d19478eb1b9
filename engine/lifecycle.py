"""An engine's end when nobody calls ``destroy()``: garbage collection and interpreter exit.

``collected``: the engine was garbage-collected; every hook it put on the model comes off and its observers
of the collectives are detached, with no collective (each rank's finalizer runs at a moment of its own).
``wait_at_exit``: at interpreter exit, an engine still alive waits for its collectives in flight.
``collecting_what_it_leaves``: the collection after a simulation (the prediction's, the planner's), which examines
only what was made inside unless a collected engine's remains wait for a full one.
See note: lifecycle (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Iterator
from typing import Any

from zeroplus import comm_observers
from zeroplus.activations import SavedTensorRouter
from zeroplus.zero import ZeroPartition

from .compile import CompiledUnits
from .model_changes import ModelChanges

logger = logging.getLogger("zeroplus.engine")
# engines collected without destroy() whose remains wait for a full collection: their hooks, held by torch's C++
# side where the collector does not see them, came off in ``collected``, so the model and its shards became a cycle
# the collector finds only in a later pass
_REMAINS = [0]


def collected(partition: ZeroPartition, activations: SavedTensorRouter, compiled: list[CompiledUnits],
               observers: list[Any], changes: ModelChanges) -> None:
    """An engine garbage-collected without ``destroy()``: every hook it put on the model removed, with no
    collective (``ZeroPartition.drop_hooks``: a stage-3 model's released parameters stay empty, and a later
    ``initialize`` refuses them); its observers of the collectives detached."""
    partition.drop_hooks()
    changes.remove()
    activations.remove()
    for units in compiled:
        units.remove()
    for observer in observers:
        comm_observers.detach(observer)
    _REMAINS[0] += 1


@contextlib.contextmanager
def collecting_what_it_leaves() -> Iterator[None]:
    """At the end, collects the reference cycles a simulation inside leaves (see note: runtime overhead), examining
    only the objects made inside: what the process held before is frozen out of that collection (``gc.freeze``; a
    full collection of a rank with Transformers imported took 0.2-0.4 s an engine, this one microseconds). A full
    collection instead where an engine collected without ``destroy()`` left its model and shards for a later pass
    (``collected``), or where the process froze objects itself (its frozen set left as it was)."""
    waiting = _REMAINS[0]
    partial = gc.get_freeze_count() == 0 and not waiting
    if partial:
        gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        if partial:
            gc.unfreeze()
        _REMAINS[0] -= waiting  # (an engine this pass collected leaves its remains for the next)


def wait_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit: wait for an engine's in-flight collectives (a failure here is reported by the
    collective's own error path, not raised at exit). Also after the script destroyed the process group:
    ``destroy_process_group`` neither waits for gloo's works nor stops its workers while the engine still
    references the group, and a worker that finishes during the interpreter's teardown aborts the process."""
    engine = ref()
    if engine is None or not engine.dp.initialized:
        return
    try:
        engine._partition.wait_in_flight()
    except Exception as err:  # noqa: BLE001 - at exit there is no caller to raise to
        logger.warning("collectives in flight at exit did not finish: %s", err)
