"""The memory ledger: the one allocation seam for every large buffer.

Every flat parameter, gradient, master, optimizer-state and communication buffer is allocated
through ``Ledger.empty`` / ``Ledger.zeros`` (or registered with ``Ledger.track``) under a
category. The ledger keeps live and peak bytes per category and overall (and each category's live
bytes at the moment the total peaked, ``at_peak``: per-category peaks need not coincide), and forgets a buffer
when its storage is freed (a weakref finalizer on the storage), when ``release`` is called, or
when its storage is resized (``resized``). Tests assert bytes per category against parameter
counts; the memory report prints the same numbers.

Savings: a memory technique records the bytes it keeps from being held (``save`` when it stops
holding them, ``unsave`` when they are held again), per technique and category, with live and
peak, so the report shows what shared master weights, recompute and swapping spared.
"""
from __future__ import annotations

import dataclasses
import enum
import threading
import weakref
from typing import Any

import torch


class Category(str, enum.Enum):
    PARAM = "param"                    # low-precision parameters (full or shard)
    PARAM_GATHERED = "param_gathered"  # stage-3 parameters gathered for compute
    GRAD = "grad"                      # gradients (full buffers and reduced shards)
    MASTER = "master"                  # fp32 master weights
    OPTIM_STATE = "optim_state"        # optimizer states (exp_avg, exp_avg_sq, momentum, ...)
    ACTIVATION = "activation"          # saved activations the engine manages
    COMM_BUFFER = "comm_buffer"        # buckets in flight
    OFFLOAD_BUFFER = "offload_buffer"  # windows of lower memory tiers


@dataclasses.dataclass
class CategoryBytes:
    live_bytes: int = 0
    peak_bytes: int = 0


class _Section:
    """One entry into the ledger's lock (``Ledger.locked``): this thread's depth counted, and the removals
    deferred while it held the lock done once the outermost section ends."""

    __slots__ = ("_ledger",)

    def __init__(self, ledger: "Ledger") -> None:
        self._ledger = ledger

    def __enter__(self) -> None:
        ledger = self._ledger
        ledger._lock.acquire()
        ledger._held.depth = getattr(ledger._held, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        ledger = self._ledger
        depth = ledger._held.depth - 1
        ledger._held.depth = depth
        ledger._lock.release()
        while depth == 0 and ledger._deferred:
            ledger._remove(ledger._deferred.pop())


class Ledger:
    """Live and peak bytes per category for this rank. Thread-safe (comm threads free buffers)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held = threading.local()  # this thread's depth inside the lock
        self._deferred: list[int] = []  # entries whose storage died while this thread held the lock
        self._section = _Section(self)
        self._bytes = {c: CategoryBytes() for c in Category}
        self._entries: dict[int, tuple[Category, int]] = {}
        # entry key -> its storage's identity (``_cdata``), or the tensors ``count_each`` counted (their storages)
        self._storage_of: dict[int, int | tuple[torch.Tensor, ...]] = {}
        self.total = CategoryBytes()
        self.at_peak: dict[Category, int] = {}  # live bytes per category when the total last reached its peak
        self._next_id = 0
        self._saved: dict[tuple[str, Category], CategoryBytes] = {}
        self.wait_seconds = 0.0  # time blocked waiting for the offload tiers (the wall-clock breakdown reads it)

    def waited(self, seconds: float) -> None:
        """An offload tier blocked its caller ``seconds`` for a read or a write."""
        with self.locked():
            self.wait_seconds += seconds

    # -- allocation -------------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, category: Category, device: torch.device | str = "cpu",
              pin: bool = False) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
        return self.track(t, category)

    def zeros(self, numel: int, dtype: torch.dtype, category: Category,
              device: torch.device | str = "cpu") -> torch.Tensor:
        return self.track(torch.zeros(numel, dtype=dtype, device=device), category)

    def track(self, tensor: torch.Tensor, category: Category) -> torch.Tensor:
        """Count ``tensor``'s storage under ``category`` until the storage dies or is released."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        with self.locked():
            self._next_id += 1
            key = self._next_id
            self._add_held(key, category, nbytes)
            self._storage_of[key] = storage._cdata
        tensor._zeroplus_ledger_key = key  # type: ignore[attr-defined]
        weakref.finalize(storage, self._remove, key)
        return tensor

    def count(self, tensor: torch.Tensor, category: Category) -> torch.Tensor:
        """Count ``tensor``'s storage under ``category`` until ``release(tensor)``. No finalizer: the caller holds
        the tensor and releases it when it lets it go (one rank's kept gradients, a hundred or more a step:
        ``track``'s finalizer cost about 2 us of its 4 per tensor)."""
        self.count_all([tensor], category)
        return tensor

    def count_all(self, tensors: list[torch.Tensor], category: Category) -> None:
        """``count`` each of ``tensors``, in one section."""
        with self.locked():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                self._next_id += 1
                key = self._next_id
                self._add_held(key, category, storage.nbytes())
                self._storage_of[key] = storage._cdata
                tensor._zeroplus_ledger_key = key  # type: ignore[attr-defined]

    def count_each(self, entries: list[tuple[list[torch.Tensor], int]], category: Category) -> list[int]:
        """Count each ``(tensors, nbytes)`` (``nbytes`` their storages' total, as the caller knows it) under
        ``category`` as one entry until ``release_key`` of its key (returned in order), in one section: no finalizer,
        no mark on a tensor, and the entry holds the tensors (so their storages) until then (``zero/kept_grads.py``:
        one rank's gradients of a whole group, which the group holds as long)."""
        with self.locked():
            first = self._next_id + 1
            for key, (tensors, nbytes) in enumerate(entries, first):
                self._entries[key] = (category, nbytes)
                self._storage_of[key] = tuple(tensors)
            self._next_id += len(entries)
            self._grow(category, sum([nbytes for _, nbytes in entries]))  # (one rise: the peaks one by one would reach)
            return list(range(first, self._next_id + 1))

    def release_key(self, key: int) -> None:
        """Stop counting the entry ``count_each`` returned."""
        self._remove(key)

    def recount(self, key: int) -> None:
        """Count ``count_each``'s entry ``key`` at its storages' sizes now (``resized`` for such an entry)."""
        with self.locked():
            entry, tensors = self._entries.get(key), self._storage_of.get(key)
            if entry is None or not isinstance(tensors, tuple):
                raise AssertionError(f"recount() of ledger entry {key}: not a live count_each entry")
            self._remove_held(key)
            self._add_held(key, entry[0], sum(t.untyped_storage().nbytes() for t in tensors))
            self._storage_of[key] = tensors

    def track_new_states(self, states: dict[str, Any], category: Category) -> None:
        """Count the multi-element tensors among ``states`` the ledger does not count yet
        (optimizer states torch created lazily in a step)."""
        for value in states.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1 and not hasattr(value, "_zeroplus_ledger_key"):
                self.track(value, category)

    def release(self, tensor: torch.Tensor) -> None:
        """Stop counting ``tensor`` now (its storage may live on elsewhere, e.g. in a comm thread)."""
        key = getattr(tensor, "_zeroplus_ledger_key", None)
        if key is not None:
            self._remove(key)

    def release_all(self, tensors: list[torch.Tensor | None]) -> None:
        """``release`` each of ``tensors`` (None skipped), in one section."""
        with self.locked():
            for t in tensors:
                key = getattr(t, "_zeroplus_ledger_key", None)
                if key is not None:
                    self._remove_held(key)

    def resized(self, tensor: torch.Tensor) -> None:
        """Record that ``tensor``'s storage was resized (stage-3 gather and release use this)."""
        key = getattr(tensor, "_zeroplus_ledger_key", None)
        if key is None:
            raise AssertionError("resized() on a tensor the ledger does not track")
        with self.locked():
            category, _ = self._entries.get(key, (None, 0))
        if category is None:
            raise AssertionError("resized() on a released tensor")
        self._remove(key)
        self._add(key, category, tensor.untyped_storage().nbytes())
        self._storage_of[key] = tensor.untyped_storage()._cdata

    # -- bookkeeping ------------------------------------------------------------------------
    def _add(self, key: int, category: Category, nbytes: int) -> None:
        with self.locked():
            self._add_held(key, category, nbytes)

    def _add_held(self, key: int, category: Category, nbytes: int) -> None:
        """``_add`` inside a section this thread holds."""
        self._entries[key] = (category, nbytes)
        self._grow(category, nbytes)

    def _grow(self, category: Category, nbytes: int) -> None:
        """Live bytes of ``category`` rise by ``nbytes`` (inside a section this thread holds); peaks follow."""
        cat = self._bytes[category]
        cat.live_bytes += nbytes
        if cat.live_bytes > cat.peak_bytes:
            cat.peak_bytes = cat.live_bytes
        self.total.live_bytes += nbytes
        if self.total.live_bytes > self.total.peak_bytes:  # (a new peak: rare once training is under way)
            self.total.peak_bytes = self.total.live_bytes
            self.at_peak = {c: b.live_bytes for c, b in self._bytes.items() if b.live_bytes}

    def locked(self) -> _Section:
        """The ledger's lock, for a section that reads or changes several counts as one (re-entrant on a thread).
        A storage can die while its thread holds it: the garbage collector runs the storage's
        finalizer (``_remove``) inside whatever allocation triggered it, ``_add``'s dict insert included, on
        the same thread. A plain lock deadlocked there (seen in the suite); that removal is deferred until
        the outermost section ends. (A class, not a generator context manager: entered about a thousand times
        a step, once per gradient kept or freed.)"""
        return self._section

    def _remove(self, key: int) -> None:
        if getattr(self._held, "depth", 0):  # a finalizer run inside this thread's locked section
            self._deferred.append(key)
            return
        with self.locked():
            self._remove_held(key)

    def _remove_held(self, key: int) -> None:
        """``_remove`` inside a section this thread holds."""
        entry = self._entries.pop(key, None)
        self._storage_of.pop(key, None)
        if entry is None:
            return
        category, nbytes = entry
        self._bytes[category].live_bytes -= nbytes
        self.total.live_bytes -= nbytes

    def save(self, technique: str, category: Category, nbytes: int) -> None:
        """``technique`` now keeps ``nbytes`` of ``category`` from being held."""
        with self.locked():
            b = self._saved.setdefault((technique, Category(category)), CategoryBytes())
            b.live_bytes += nbytes
            b.peak_bytes = max(b.peak_bytes, b.live_bytes)

    def unsave(self, technique: str, category: Category, nbytes: int) -> None:
        self.save(technique, category, -nbytes)

    def saved_bytes(self, technique: str, category: Category) -> int:
        b = self._saved.get((technique, Category(category)))
        return 0 if b is None else b.live_bytes

    def storage_keys(self) -> set[int]:
        """The identities (``_cdata``) of the storages counted now (the estimator's tracker asks)."""
        with self.locked():
            out: set[int] = set()
            for k in self._entries:
                ident = self._storage_of.get(k)
                if isinstance(ident, tuple):
                    out.update(t.untyped_storage()._cdata for t in ident)
                elif ident is not None:
                    out.add(ident)
            return out

    def live_bytes(self, category: Category | None = None) -> int:
        return self.total.live_bytes if category is None else self._bytes[Category(category)].live_bytes

    def peak_bytes(self, category: Category | None = None) -> int:
        return self.total.peak_bytes if category is None else self._bytes[Category(category)].peak_bytes

    def reset_peaks(self) -> None:
        with self.locked():
            for cat in list(self._bytes.values()) + list(self._saved.values()):
                cat.peak_bytes = cat.live_bytes
            self.total.peak_bytes = self.total.live_bytes
            self.at_peak = {c: b.live_bytes for c, b in self._bytes.items() if b.live_bytes}

    def snapshot(self) -> dict[str, Any]:
        with self.locked():
            out = {c.value: dataclasses.asdict(b) for c, b in self._bytes.items()}
            out["total"] = dataclasses.asdict(self.total)
            out["saved"] = {f"{t}/{c.value}": dataclasses.asdict(b) for (t, c), b in sorted(self._saved.items())}
        return out
