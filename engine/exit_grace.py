"""A process that ran gloo collectives gives gloo's workers the GIL once more before the interpreter's teardown.

A blocking gloo collective (torch's object collectives, a trainer's metric all-reduces and
``all_gather``) returns as soon as its work is marked done; the worker thread drops its own reference
to the work a moment later. If the caller's Python tensor is gone by then, the worker holds the last
reference and freeing it takes the GIL. During ``Py_FinalizeEx`` a non-main thread asking for the GIL
is ended with ``pthread_exit``, whose forced unwinding through the work's destructor calls
``std::terminate``: the process aborts after its last line ("terminate called without an active
exception", exit -6). Atexit handlers run while the interpreter is still whole, so sleeping there,
with the GIL released, lets every such worker finish its release first.

Registered once per process, when the first engine is built, and independent of that engine's life:
Hugging Face's Trainer drops its engine before the script returns, and the engine's own exit handler
(which waits for its in-flight collectives) then has nothing to run for, while the Trainer's last
``all_gather`` of its FLOP count is still being released by gloo's worker. Costs ``EXIT_GRACE_SECONDS``
at exit, no memory.
See note: exit abort (docs/design-notes.md).
"""
from __future__ import annotations

import atexit
import time

EXIT_GRACE_SECONDS = 0.05

_registered = False


def release_gil_before_teardown() -> None:
    """The atexit handler: sleep with the GIL released (see the module's docstring)."""
    time.sleep(EXIT_GRACE_SECONDS)


def register_exit_grace() -> None:
    """Register the handler once per process. Atexit runs handlers last-registered-first, so the first
    engine's registration runs after every engine's own exit wait, which is registered later."""
    global _registered
    if not _registered:
        atexit.register(release_gil_before_teardown)
        _registered = True
