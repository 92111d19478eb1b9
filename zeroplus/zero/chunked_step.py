"""The optimizer step chunk by chunk: for a split (shared-storage) master, a bf16 master, a master on a tier
(``tiered_master.py``, read and rewritten chunk by chunk the same way, the next chunk's read
started before the current chunk steps), and optimizer states offloaded to a lower tier
(``offload/optimizer_states.py``).

Offloaded states: the owned range is stepped one sub-group at a time; the sub-group's states come
from the tier (prefetched while the previous sub-group steps) and go back after its step. The
master (whole or split) is read and written the same way as below.

Split master:

For each chunk ``[a, b)`` of the owned range: merge the bf16 high halves and int16 residuals into
one reusable fp32 buffer (the exact fp32 master), point the group's master parameter at it and at
the chunk's gradient, give the optimizer the chunk's slices of the full-size per-element states
(and the pre-step value of every scalar state, such as ``step``), step, and split the result back.
No full-size fp32 temporary exists: the extra memory is one chunk of fp32 (``chunk_numel``
elements, 4 MiB at the default 2^20) and the kernels' int32 scratch (at most 4 MiB).

This is exact for element-wise optimizers (Adam, AdamW, SGD, RMSprop, Adamax, NAdam, RAdam,
Adadelta): each element's update depends only on that element and the scalars. fp8 moments keep a scale per block
of elements: the chunks then start at multiples of the block (``chunk_numel`` rounded down to one) and each chunk
gets its blocks' slice of the scales, so it quantizes the blocks the whole shard has. Any other
optimizer (LAMB needs per-parameter norms over the whole shard) steps the owned range as one
chunk. Per-element states are created full-size on the first step, in the ledger
(``optim_state``), from what the optimizer creates for each chunk.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..kernels import bf16_split
from ..kernels.block_fp8 import blocks
from ..ledger import Category, Ledger
from ..offload.optimizer_states import TieredStates, per_element, scale_block
from ..optim.stored_states import StoredStates
from .flat_group import FlatParamGroup

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)


def _per_block(key: str, block: int) -> bool:
    """Whether state ``key`` has one value per block of elements (an fp8 moment's scales) rather than per element."""
    return block > 1 and key.endswith("_scale")


def _copy_scalar(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class ChunkedStep:
    def __init__(self, optimizer: torch.optim.Optimizer, ledger: Ledger, chunk_numel: int) -> None:
        self.optimizer = optimizer
        self.ledger = ledger
        self.chunk_numel = int(chunk_numel)
        self.elementwise = isinstance(optimizer, ELEMENTWISE)

    def _scratch(self, store: Any, chunk: int, device: torch.device) -> torch.Tensor:
        """The int32 scratch the store's reads and writes take: ``store.scratch_rows`` rows of up to
        ``bf16_split.CHUNK`` elements, flat."""
        return self.ledger.empty(store.scratch_rows * min(chunk, bf16_split.CHUNK), torch.int32, Category.MASTER,
                                 device)

    def _holding(self) -> contextlib.AbstractContextManager[None]:
        """An optimizer that makes chunk buffers in each ``step()`` (stored states) keeps them over this step's
        chunks."""
        return self.optimizer.holding() if isinstance(self.optimizer, StoredStates) else contextlib.nullcontext()

    def step_tiered(self, g: FlatParamGroup, states: TieredStates, grad: torch.Tensor) -> None:
        """One step of group ``g`` whose optimizer states are ``states`` (offloaded), sub-group by sub-group."""
        with self._holding():
            self._step_tiered(g, states, grad)

    def _step_tiered(self, g: FlatParamGroup, states: TieredStates, grad: torch.Tensor) -> None:
        param, opt, store = g.master_param, self.optimizer, g.master_store
        copied = store.copied  # the master is read into a work buffer and written back
        work: torch.Tensor | None = None
        scratch: torch.Tensor | None = None
        store.begin_step()
        if copied:
            work = self.ledger.empty(max(b - a for a, b in states.chunks), torch.float32, Category.MASTER,
                                     grad.device)
            scratch = self._scratch(store, work.numel(), grad.device)
        placeholder = param.data
        try:
            states.prefetch(0)  # normally already in flight: the previous group's steps read ahead
            store.prefetch_range(*states.chunks[0])
            for k, (a, b) in enumerate(states.chunks):
                states.window.ahead(states, k)
                if k + 1 < len(states.chunks):
                    store.prefetch_range(*states.chunks[k + 1])
                values = store.read(a, b) if work is None else store.read_into(a, b, work[:b - a], scratch)
                param.data, param.grad = values, grad[a:b]
                opt.state[param] = states.get(k)
                opt.step()
                states.put(k, opt.state.pop(param))
                if copied:
                    store.write(a, values, scratch)
        finally:
            param.data, param.grad = placeholder, None

    def step(self, g: FlatParamGroup, grad: torch.Tensor) -> None:
        """One optimizer step of group ``g`` with its fp32 gradient ``grad`` (owned length)."""
        with self._holding():
            self._step(g, grad)

    def _step(self, g: FlatParamGroup, grad: torch.Tensor) -> None:
        store, param, opt = g.master_store, g.master_param, self.optimizer
        owned = store.numel
        block = scale_block(opt)  # fp8 moments: a scale per block, so chunks start at multiples of it
        chunk = max(1, min(self.chunk_numel, owned) // block * block) if self.elementwise else owned
        chunk = min(max(chunk, block), owned)
        work = self.ledger.empty(chunk, torch.float32, Category.MASTER, grad.device)
        scratch = self._scratch(store, chunk, grad.device)
        store.begin_step()
        state = opt.state.pop(param, {})
        first = not state  # every chunk then starts from the optimizer's own initial state

        def span(key: str, a: int, b: int) -> slice:
            """Where elements ``[a, b)`` of a per-element state are, or of a per-block one (fp8 scales)."""
            return slice(a // block, blocks(b, block)) if _per_block(key, block) else slice(a, b)
        sliced = {k for k, v in state.items() if per_element(v, owned) or
                  (_per_block(k, block) and isinstance(v, torch.Tensor) and v.numel() == blocks(owned, block))}
        scalars = {k: v for k, v in state.items() if k not in sliced}
        placeholder = param.data
        try:
            store.prefetch_range(0, min(chunk, owned))
            for a in range(0, owned, chunk):
                b = min(a + chunk, owned)
                if b < owned:
                    store.prefetch_range(b, min(b + chunk, owned))
                values = store.read_into(a, b, work[:b - a], scratch)
                param.data, param.grad = values, grad[a:b]
                chunk_state: dict[str, Any] = {}
                if not first:
                    chunk_state = {k: state[k][span(k, a, b)] for k in sliced}
                    chunk_state.update({k: _copy_scalar(v) for k, v in scalars.items()})
                opt.state[param] = chunk_state
                opt.step()
                for key, value in opt.state.pop(param).items():
                    if key not in sliced and first and (per_element(value, b - a) or _per_block(key, block)):
                        whole = blocks(owned, block) if _per_block(key, block) else owned
                        state[key] = torch.zeros(whole, dtype=value.dtype, device=value.device)
                        self.ledger.track_new_states({key: state[key]}, Category.OPTIM_STATE)  # (multi-element ones)
                        sliced.add(key)
                    if key in sliced:
                        part = state[key][span(key, a, b)]
                        if value.data_ptr() != part.data_ptr():
                            part.copy_(value)
                    else:
                        state[key] = value  # scalars: the last chunk's are the step's
                store.write(a, values, scratch)
        finally:
            param.data, param.grad = placeholder, None
            opt.state[param] = state
