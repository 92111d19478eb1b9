"""A table shard on a slower tier (host memory, files), its hot rows cached in device memory.

``RowCache(rows, widths, capacity, tier)`` keeps each component of a shard (the weights, ``cols`` wide, and
the optimizer's states: per element ``cols`` wide, per row 1) whole on ``tier`` (``offload.tier_tensor``: one
pinned host tensor, or one file, per component) and ``capacity`` rows of every component in memory, in slots.
A lookup brings its rows in first (``fetch``): each row not resident takes a free slot, or the slot of the
least recently used row not needed since the last step (LRU), whose values, if the optimizer changed them, are
written back first; missing rows are read in. Both by rows (``tier_tensor``'s ``read_rows``/``write_rows``: a
file read per span of rows at most 64 apart, a write per run of consecutive rows, in the calling thread). The
pooling, the backward and the optimizer then work on the slots (``slots_of``) exactly as on a resident shard:
the same values, the same arithmetic. Rows fetched since the last step stay pinned until ``step_done`` (their
gradients wait for the step). ``flush`` writes every changed row back (checkpoints, ``full_table``).

Hit rate: the distinct rows each fetch needed that were already resident, over all distinct rows fetched.

Memory on the device: ``capacity x (sum of widths) x 4`` bytes of slots, plus 8 bytes per slot (its row, its
last use) and 8 per shard row (``slot_of``, int64: the map from a row to its slot). On the tier: the whole shard,
``rows x (sum of widths) x 4``. Per fetch: the missing spans' values in transit (a host buffer of at most 64
times the missing rows' bytes, freed as copied).
Where the tier is the host of a CPU-only machine, the tier holds the shard in the same memory (no saving):
files are what a CPU run offloads to.
"""
from __future__ import annotations

import torch

from ..offload.tier_tensor import FileTierTensor, HostTierTensor, keep
from ..offload.tiers import Tier


class CacheTooSmall(RuntimeError):
    """One step's distinct rows do not fit in the cache."""


class RowCache:
    def __init__(self, rows: int, widths: dict[str, int], capacity: int, tier: Tier | None,
                 initial: dict[str, torch.Tensor], name: str = "") -> None:
        """``initial``: each component's whole shard ``(rows, width)`` (or ``(rows,)`` for width 1 per-row
        states, kept 1-D), moved to ``tier`` (None: the meta device, the estimate's; no tier, no values)."""
        self.rows, self.widths, self.name = rows, dict(widths), name
        self.capacity = max(1, min(capacity, rows))
        device = next(iter(initial.values())).device
        self.one_d = {k for k, v in initial.items() if v.dim() == 1}
        self.slots = {k: torch.zeros(self.capacity, w, device=device) if k not in self.one_d
                      else torch.zeros(self.capacity, device=device) for k, w in self.widths.items()}
        self.backing: dict[str, HostTierTensor | FileTierTensor] = {}
        if tier is not None:
            self.backing = {k: keep(tier, initial[k].reshape(-1)) for k in self.widths}
        self.slot_of = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.row_in = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        self.last_used = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.dirty = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self.pinned = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self.tick = 1
        self.hits = self.fetched = 0

    @property
    def device(self) -> torch.device:
        return self.slot_of.device

    def to(self, device: torch.device | str) -> None:
        """The slots and the maps moved to ``device`` (the tier stays where it is)."""
        self.slots = {k: v.to(device) for k, v in self.slots.items()}
        for name in ("slot_of", "row_in", "last_used", "dirty", "pinned"):
            setattr(self, name, getattr(self, name).to(device))

    def hit_rate(self) -> float:
        return self.hits / self.fetched if self.fetched else 0.0

    # --- bringing rows in ----------------------------------------------------------------------------------
    def fetch(self, rows: torch.Tensor) -> None:
        """Make every row of ``rows`` (local rows, any order, duplicates allowed) resident and pinned."""
        if rows.numel() == 0 or self.device.type == "meta":
            return
        wanted = torch.unique(rows)
        slots = self.slot_of[wanted]
        missing = wanted[slots < 0]
        self.fetched += wanted.numel()
        self.hits += wanted.numel() - missing.numel()
        resident = slots[slots >= 0]
        self.pinned[resident] = True
        self.last_used[resident] = self.tick
        if missing.numel():
            free = self._free(missing.numel())
            self._write_back(free)
            self._read_in(missing, free)
            self.slot_of[self.row_in[free][self.row_in[free] >= 0]] = -1
            self.row_in[free] = missing
            self.slot_of[missing] = free
            self.dirty[free] = False
            self.pinned[free] = True
            self.last_used[free] = self.tick

    def _free(self, n: int) -> torch.Tensor:
        """``n`` slots for new rows: empty ones first, then the least recently used unpinned ones."""
        candidates = torch.nonzero(~self.pinned).squeeze(1)
        if candidates.numel() < n:
            raise CacheTooSmall(f"embedding table {self.name!r}: the row cache holds {self.capacity} rows and this "
                                f"step needs {int(self.pinned.sum()) + n} distinct rows of it (looked up since the "
                                f"last step); give the table a larger cache_rows")
        age = torch.where(self.row_in[candidates] < 0, -1, self.last_used[candidates])  # empty slots first
        return candidates[torch.argsort(age, stable=True)[:n]]

    def _write_back(self, slots: torch.Tensor) -> None:
        changed = slots[self.dirty[slots]]
        if not changed.numel() or not self.backing:
            return
        rows, order = torch.sort(self.row_in[changed])
        chosen, listed = changed[order], rows.tolist()
        for k, backing in self.backing.items():
            values = self.slots[k][chosen]
            backing.write_rows(listed, values.unsqueeze(1) if k in self.one_d else values)

    def _read_in(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows (sorted: ``torch.unique``'s) read from the tier into ``slots``, one gather per component."""
        if not self.backing:
            return
        listed = rows.tolist()
        for k, backing in self.backing.items():
            values = backing.read_rows(listed, self.widths[k])
            self.slots[k][slots] = values.squeeze(1) if k in self.one_d else values

    # --- the step and what reads whole shards ----------------------------------------------------------------
    def slots_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The slots of resident ``rows`` (fetched since the last step)."""
        return self.slot_of[rows]

    def changed(self, slots: torch.Tensor) -> None:
        """The optimizer wrote ``slots``: written back before their rows leave."""
        self.dirty[slots] = True

    def step_done(self) -> None:
        """The step applied every pending gradient: no row needs to stay."""
        self.pinned[:] = False
        self.tick += 1

    def flush(self) -> None:
        """Every changed row written back to the tier (and the writes waited for)."""
        resident = torch.nonzero(self.row_in >= 0).squeeze(1)
        self._write_back(resident)
        self.dirty[:] = False

    def whole(self, key: str) -> torch.Tensor:
        """Component ``key`` of the whole shard, read from the tier after a flush (holds the shard once)."""
        self.flush()
        if not self.backing:
            return self.slots[key]
        values = self.backing[key].read(0, self.rows * self.widths[key]).result().clone()  # after the writes
        return values if key in self.one_d else values.view(self.rows, self.widths[key])

    def replace(self, values: dict[str, torch.Tensor]) -> None:
        """Components replaced whole (a load): written to the tier, every slot emptied (changed rows of the
        components not replaced written back first)."""
        self.flush()
        for k, v in values.items():
            self.backing[k].write(0, v.reshape(-1).contiguous().clone())
        self.slot_of[:] = -1
        self.row_in[:] = -1
        self.dirty[:] = False
        self.pinned[:] = False

    def close(self) -> None:
        for backing in self.backing.values():
            backing.close()
        self.backing = {}


__all__ = ["CacheTooSmall", "RowCache"]
