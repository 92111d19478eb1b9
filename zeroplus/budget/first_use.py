"""What a process pays once, the first time it trains anything: read from what the process already holds.

On CPU most of a training process's non-tensor memory is torch's own code, paged in from its shared
libraries the first time a training step runs its kernels (measured here for a small GPT's first
step: 19 MiB of ``libtorch_cpu.so`` and 1.4 of ``libtorch_python.so`` in fp32, 22 and 1.4 in bf16,
beside 1-11 MiB of generated kernels). A process that has trained or evaluated something already (a
test session, a script that evaluated its model first, the Trainer after an evaluation) has those
pages resident; a fresh one pays them inside the engine. A script that had trained a small model
before ``initialize`` measured 13 MiB of engine peak where a fresh one measured 26; both were
predicted 26 from the probe's figure.

``code_resident()`` is the resident size of torch's libraries (the mappings under ``torch/lib`` in
``/proc/self/smaps``; None where that file does not exist). The runtime probe
(``runtime_probe.py``) records it after building its model, after ``initialize`` and after training;
a prediction for a process that already holds more of that code than the probe did after building
its model takes the difference off the probe's overhead, up to what the probe's own run paged in
(``runtime_overhead.runtime_bytes``). The generated kernels are per matrix shape, so no process has
paid them for a model it has not run: they stay in the prediction.

A first version ran a small model's training step at ``initialize`` and measured what it left: as
exact, but it paid 8-10 MiB of that model's own kernels in every fresh process (the example budget
job went over its budget). Reading the mappings costs a few milliseconds and no memory.
See note: first use (docs/design-notes.md).
"""
from __future__ import annotations

import os

_SMAPS = "/proc/self/smaps"
_TORCH_LIB = os.sep + os.path.join("torch", "lib") + os.sep


def code_resident() -> int | None:
    """Resident bytes of torch's shared libraries in this process, or None (no ``/proc/self/smaps``)."""
    try:
        with open(_SMAPS) as f:
            total, inside = 0, False
            for line in f:
                head = line.split(maxsplit=6)
                if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                    inside = len(head) > 5 and _TORCH_LIB in head[5]
                elif inside and head and head[0] == "Rss:":
                    total += int(head[1]) * 1024
            return total
    except OSError:
        return None


__all__ = ["code_resident"]
