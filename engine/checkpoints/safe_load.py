"""Reading checkpoint files without running code from them.

Every ``torch.load`` in zeroplus goes through ``load_weights_only``: torch's weights-only unpickler,
which rebuilds tensors, numbers, strings and containers and refuses any other global before calling
it, so a file holding a pickled ``__reduce__`` (``os.system``, ``eval``, ...) is an error naming the
file and the global, and nothing of it runs. A SHA-256 beside a file cannot give that guarantee: whoever
rewrites the file rewrites the digest.

The allow-list: zeroplus's own rank files need nothing beyond torch's defaults (the NumPy RNG state is
stored as a list, ``numpy_rng_to_file``). DeepSpeed's checkpoints pickle a few of DeepSpeed's own
objects (fragment addresses, its loss scaler, the ZeRO stage enum); each is rebuilt as an ``Inert``
record that holds the pickled fields as attributes and runs no code, whether or not DeepSpeed is
installed. Memory: the file's tensors, nothing more (``torch.load`` reads into fresh storages).
See note: weights only (docs/design-notes.md).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

import numpy as np
import torch


class Inert:
    """Stands in for a class of another library's pickle: keeps what was pickled, runs none of its code.
    ``args`` are the constructor arguments (an enum's value); the pickled state becomes attributes."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    @property
    def value(self) -> Any:
        """An enum's value (``ZeroStageEnum(2).value``)."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"Inert({self.args}, {self.__dict__})"


# DeepSpeed's pickled classes (0.19), each read as an Inert record.
DEEPSPEED_CLASSES = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
)


def _inert_named(qualified: str) -> type:
    module, _, name = qualified.rpartition(".")
    return type(name, (Inert,), {"__module__": module, "__qualname__": name})


_DEEPSPEED_STANDINS = [(_inert_named(q), q) for q in DEEPSPEED_CLASSES]


class UnsafeCheckpointError(ValueError):
    """A file asks the unpickler for something beyond tensors and containers: refused, nothing ran."""


def load_weights_only(source: str | BinaryIO | bytes, *, what: str, deepspeed: bool = False,
                      mmap: bool = False) -> Any:
    """``torch.load`` with the weights-only unpickler (on CPU). ``what`` names the file in errors
    (its path, and whose it is); ``deepspeed``: also read DeepSpeed's pickled classes as ``Inert``; ``mmap`` (a
    path): the tensors are mapped from the file, paged in when touched."""
    stream: Any = io.BytesIO(source) if isinstance(source, bytes) else source
    allowed: list[Any] = list(_DEEPSPEED_STANDINS) if deepspeed else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(stream, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        reason = _refused_global(str(err))
        raise UnsafeCheckpointError(
            f"refused to load {what}: it pickles objects that are not tensors or plain containers, and loading "
            f"them could run code ({reason}). Nothing from the file was executed; if you made this file "
            f"yourself, store only tensors, numbers, strings, lists, tuples and dicts in it") from None


def _refused_global(message: str) -> str:
    """The unpickler's reason in one line ("Unsupported global: GLOBAL os.system ..."), without torch's advice
    to load the file unsafely."""
    tail = message.split("WeightsUnpickler error:", 1)[-1].strip()
    return tail.split(". Please use", 1)[0].splitlines()[0].strip() if tail else "unknown"


def numpy_rng_to_file(state: Any) -> tuple:
    """``np.random.get_state()`` with its key array as a list of ints (the weights-only unpickler reads it)."""
    kind, keys, pos, has_gauss, cached = state
    return (kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached))


def numpy_rng_from_file(state: tuple) -> tuple:
    kind, keys, pos, has_gauss, cached = state
    return (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)


def check_loadable(obj: Any, *, what: str) -> None:
    """Refuse, before anything is written, an object that ``load_weights_only`` would refuse later
    (a client state holding a custom class): the error names ``what``. Costs one serialised copy of it."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    try:
        load_weights_only(buffer, what=what)
    except UnsafeCheckpointError as err:
        raise TypeError(str(err).replace("refused to load", "refused to save", 1)
                        .split(". Nothing from")[0] + ": a checkpoint never runs code when loaded, so it may hold "
                        "only tensors, numbers, strings, lists, tuples and dicts") from None

