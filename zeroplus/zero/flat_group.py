"""One flat buffer: the trainable parameters of one unit that share one optimizer param group.

Layout. The parameters are laid end to end (``numel`` elements), padded with zeros to
``padded_numel = ceil(numel / N) * N`` and cut into ``N`` equal shards of ``shard_numel``
elements; rank r owns ``[r * shard_numel, (r + 1) * shard_numel)``. At stage 0 a rank owns the
whole buffer (every rank steps everything).

Memory per rank (P = padded_numel, S = P / N, c = bytes of the compute dtype):

=========  =========================  =====================  ================================
stage      low-precision params       fp32 master            gradients
=========  =========================  =====================  ================================
0          c * P (``full``)           4 * P (alias if fp32)  c * P, plus one group's 4 * P at
                                                             the step
1          c * P (``full``)           4 * S (alias if fp32)  c * P until the boundary, then
                                                             c * S reduced
2          c * P (``full``)           4 * S (alias if fp32)  c * P per group while it reduces;
                                                             c * S reduced (4 * S when
                                                             accumulating micro-batches)
3          c * P only while gathered  4 * S                  as stage 2
=========  =========================  =====================  ================================

At stage 3 on one rank in fp32 the master is ``full`` itself and is never released (``resident``):
releasing would save nothing, the master holding the same 4 * P bytes. Otherwise, at stage 3 no
low-precision shard is kept: the gather casts the fp32 master shard into a c * S
buffer that lives only until the all-gather is done (FSDP2 keeps its sharded parameters in
fp32 the same way). ``full`` at stage 3 is one tensor object whose storage is resized to 0 when
released and back to ``c * P`` when gathered, so the views the parameters and autograd hold stay
valid. A reduced shard in the compute dtype becomes fp32 one group at a time inside the step.

Frozen groups (stage 3: parameters no optimizer trains, a LoRA model's base): this rank's shard in the group's dtype
(the compute dtype, or a quantized weight's storage dtype: ``quantized.py``; its gathers copy, never cast), c * S, and
nothing else: no master, no gradient buffer, no optimizer state; they are gathered and released with their unit like
the rest (a 7B base in bf16 is 14 GB / N per rank, plus one unit gathered; with
``zero_quantized_nontrainable_weights`` int8 codes and block scales, about 7.1 GB / N). They are not among the
partition's trained groups (``ZeroPartition.frozen``), and not offloaded with ``offload_param`` (their shard stays on
the device).

With shared-storage master weights (``master_store.SharedMaster``, bf16 only) the fp32 master
column becomes a 2-byte residual per owned element at stages 0-2 (the bf16 high halves are the
owned range of ``full``), and at stage 3 a bf16 shard plus a residual (2 + 2 bytes), with no
cast buffer for the gathers. With bf16 master weights (``master_store.Bf16Master``) there is no master column: 0
bytes at stages 0-2, the 2-byte bf16 shard at stage 3 (see note: bf16 master weights).
See note: stage-3 shard; see note: one rank (docs/design-notes.md).
"""
from __future__ import annotations

import enum
import math
from typing import Any

import torch

from ..collectives import AllGather, Collectives, Handle
from ..config import ZeroStage
from ..ledger import Category, Ledger
from ..offload.policies import MasterPolicy
from . import init_shards, quantized_comm
from .buffer_pool import BufferPool
from .group_grad import GroupGrad
from .master_store import Bf16Master, FullMaster, MasterStore, SharedMaster
from .param_status import ParamStatus, mark
from .tiered_master import TieredMaster
from .two_level_gather import TwoLevelGather

FLAT_ATTR = "_zeroplus_flat_group"
# gathers to issue together (``FlatParamGroup.join_gather``): per process group and dtype, each flat group with its
# ``(output, input)``
Joined = dict[tuple[Collectives, torch.dtype], list[tuple["FlatParamGroup", torch.Tensor, torch.Tensor]]]


class Residency(enum.Enum):
    """What a flat group holds of its parameters' values (stage 3 moves through all three; stages 0-2 stay
    ``GATHERED``). Bytes on this rank beyond the shard (``shard_numel`` elements, always held):

    - ``RELEASED``: nothing; every parameter reads as an empty tensor (see note: released parameters).
    - ``GATHERING``: the full buffer (``padded_numel`` in the compute dtype) is allocated and an all-gather is
      writing it; the parameters still read as released. Only ``expose()`` (after the wait) moves on.
    - ``GATHERED``: the full buffer holds the values and every parameter is a view of it.

    Transitions, all in ``FlatParamGroup``: ``gather()`` RELEASED -> GATHERING, ``expose()`` GATHERING ->
    GATHERED, ``release()`` GATHERED -> RELEASED (a resident group, one rank in fp32, never releases);
    releasing while GATHERING would free a buffer a collective is writing, and raises."""

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class MasterLayout(enum.Enum):
    """How a group keeps the values of its owned range (O elements: S at stages 1-3, P at stage 0; c bytes per
    element of the compute dtype), chosen once at construction. ``shard`` is what an all-gather sends,
    ``master`` the fp32 tensor when one exists whole; the master store (``master_store.py``) reads and writes
    the layout for the step.

    - ``FROZEN``: no master: ``shard``, c * S in the group's dtype, is all (stage 3, untrained parameters).
    - ``FROZEN_CODES``: no master and no ``shard``: the master store keeps the frozen shard as int8 codes and fp32
      block scales, about 1.016 * S bytes (``zero_quantized_nontrainable_weights``; ``quantized_comm.QuantizedShard``).
    - ``FP32_ALIAS``: fp32 training, the owned range of ``full`` is both ``shard`` and ``master`` (stages 0-2,
      and stage 3's ``resident`` group): 0 bytes beyond ``full``.
    - ``FP32_OWN``: fp32 at stage 3: ``full`` is released, so ``shard`` = ``master`` is its own 4 * S copy.
    - ``LOW_PRECISION``: ``master`` is an fp32 copy, 4 * O; ``shard`` is the owned range of ``full`` at stages
      0-2, none at stage 3 (each gather casts the master into a c * S buffer).
    - ``SHARED``: bf16 with shared-storage masters: ``shard`` the bf16 high halves (``full``'s range at stages
      0-2, a 2 * S copy at stage 3) plus a 2 * O residual; no ``master``.
    - ``BF16``: bf16 masters: ``shard`` is the master (``full``'s range at stages 0-2: 0 bytes beyond ``full``; a
      2 * S copy at stage 3); no ``master``.
    - ``TIERED``: stage 3 with ``offload_param``: the master on a host or NVMe tier (``tiered_master.py``), no
      ``shard`` and no ``master`` on the device."""

    FROZEN = "frozen"
    FROZEN_CODES = "frozen codes"
    FP32_ALIAS = "fp32 alias"
    FP32_OWN = "fp32 own"
    LOW_PRECISION = "low precision"
    SHARED = "shared"
    BF16 = "bf16"
    TIERED = "tiered"


class FlatParamGroup:
    """Flat storage and shard bookkeeping for one list of parameters; its gradient is ``gradient`` (group_grad.py)."""

    def __init__(self, name: str, named_params: list[tuple[str, torch.nn.Parameter]], group_index: int,
                 stage: ZeroStage, dp: Collectives, compute_dtype: torch.dtype, ledger: Ledger,
                 master: MasterPolicy = MasterPolicy(), device: torch.device | None = None,
                 trainable: bool = True, expert_ranks: list[int] | None = None,
                 secondary: Collectives | None = None, levels: TwoLevelGather | None = None) -> None:
        """``master``: shared storage, rounding, and the tier for the master shard (stage 3, ``tiered_master.py``).
        ``device``: where the flat buffer lives (default: the first parameter's device); the parameters are copied
        into it from wherever they are, cast to ``compute_dtype`` (a parameter ``zeroplus.Init`` partitioned is
        gathered first, one at a time), and every rank takes the group's first rank's values. ``trainable`` False
        (stage 3 only): frozen parameters, kept as this rank's shard in the compute dtype and nothing else (see
        note: frozen groups). ``expert_ranks``: an expert's parameters, partitioned over the expert-data group
        ``dp``; the data rank whose checkpoint file holds each of its ranks' shards. ``secondary``: hpZ's group
        (stage 3, consecutive ranks of ``dp``) over which the values gathered for a forward are kept until the next
        step (``release(keep_secondary=True)``); None or one rank: none. ``levels``: MiCS's hierarchical gather over
        ``dp`` (``two_level_gather.py``), which the parameters' gathers take instead of ``dp``'s; None: one level."""
        self.name = name
        self.trainable = trainable
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.group_index = group_index
        self.stage = stage
        self.dp = dp
        self.values_group: AllGather = levels if levels is not None else dp  # what the parameters' gathers run over
        self.expert = expert_ranks is not None
        # the data rank whose checkpoint file holds each dp rank's shard
        self.file_ranks = list(range(dp.size)) if expert_ranks is None else list(expert_ranks)
        self.unit: Any = None   # the unit holding this group, the partition (one engine's) holding that, and its
        self.owner: Any = None  # pool of freed gathered buffers (``buffer_pool.py``): ``attach()``
        self.pool = BufferPool(ledger, lookahead=0)  # (never opened: every buffer allocated and freed, until attach)
        self.ledger = ledger
        self.compute_dtype = compute_dtype
        # hpZ (see note: hpz): the group the secondary copy is split over, and this rank's part while it holds one
        self.secondary_group = secondary if secondary is not None and secondary.size > 1 else None
        self._secondary: torch.Tensor | None = None
        self._secondary_quantized = False  # it copied dequantized values (qwZ)
        self.quantized = False  # qwZ: ``full`` holds dequantized codes (``all_gather_into_full``)
        self.device = self.params[0].device if device is None else torch.device(device)
        self._lay_out(dp, stage)
        start = self.owned_start
        from_chunks = self._make_full(stage, dp)

        # Stage 3 on one rank in fp32: the master is the whole buffer, so the parameters stay gathered on
        # it (4 * P in all instead of 4 * P plus the units gathered, and no copy per gather)
        self.resident = (stage.shards_parameters and dp.size == 1 and compute_dtype == torch.float32
                         and not master.shared and master.offload is None and not from_chunks)
        owned_view = self._full_data[start:start + self.owned_numel]
        if from_chunks:  # (Init's chunks hold rank 0's values already: no broadcast)
            self.full.untyped_storage().resize_(0)
            ledger.resized(self.full)
            with torch.no_grad():
                owned_view = init_shards.redistribute(self.params, self.offsets, self.numels, self.padded_numel,
                                                      dp, compute_dtype)
        self._lay_out_values(owned_view, master, trainable)
        # One rank in fp32 (see note: one-rank gradients): autograd's own gradients are kept, uncopied, until
        # something needs the flat buffer or the step takes them as they are
        keeps = trainable and dp.size == 1 and expert_ranks is None and self.layout is MasterLayout.FP32_ALIAS
        self.gradient = GroupGrad(name, self.shapes, self.offsets, self.padded_numel, self.owned_numel, compute_dtype,
                                  self.device, ledger, keeps, stage.partitions)
        self.gathers: list[Handle] = []  # the parameters' all-gathers in flight after a step (stages 1-2, persistent)
        self.residency = Residency.GATHERED  # built whole; stage 3 releases it just below
        if stage.shards_parameters:
            self.release()

    def _make_full(self, stage: ZeroStage, dp: Collectives) -> bool:
        """The full low-precision buffer, the parameters made views into it. True where ZeRO-3 builds it over
        ``zeroplus.Init``'s chunks: this rank's part then comes from them in one all-to-all, and the buffer is never
        filled (it holds memory only for the views)."""
        full_category = Category.PARAM_GATHERED if stage.shards_parameters else Category.PARAM
        self.full = self.ledger.empty(self.padded_numel, self.compute_dtype, full_category, self.device)
        from_chunks = stage.shards_parameters and init_shards.chunked_over(self.params, dp)
        if not from_chunks:
            self._copy_in()
        self._point_params_at_views()
        return from_chunks

    def _lay_out(self, dp: Collectives, stage: ZeroStage) -> None:
        """The parameters end to end, padded to a multiple of the ranks, and the range this rank owns (the module's
        docstring)."""
        self.shapes = [p.shape for p in self.params]
        self.dtypes = [p.dtype for p in self.params]  # as built (a pretrained load casts to them first)
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.padded_numel = math.ceil(self.numel / dp.size) * dp.size
        self.shard_numel = self.padded_numel // dp.size
        self.owned_start = dp.rank * self.shard_numel if stage.partitions else 0
        self.owned_numel = self.shard_numel if stage.partitions else self.padded_numel

    @torch.no_grad()
    def _copy_in(self) -> None:
        """The parameters' values into ``full``, one parameter whole at a time, the padding zeroed; then every rank
        takes the first rank's values."""
        for p, off, n in zip(self.params, self.offsets, self.numels):
            source = init_shards.adopt(p) if init_shards.shard_of(p) is not None else p.detach()
            self.full[off:off + n].copy_(source.reshape(-1))
        self.full[self.numel:].zero_()
        self.dp.broadcast(self.full)

    def _point_params_at_views(self) -> None:
        """Every parameter becomes its view of ``full`` (and names this group, for ``GatheredParameters``)."""
        # ``.data`` has its own version counter: writing through it (gathers, post-step copies)
        # does not invalidate the parameter views autograd saved for backward.
        self._full_data = self.full.data
        self._views = [self.full[off:off + n].view(shape)
                       for off, n, shape in zip(self.offsets, self.numels, self.shapes)]
        # what a released parameter holds (see note: released parameters): no elements, over the buffer's
        # storage, so the parameter's storage stays the same object whether gathered or not
        self._released = self.full[:0]
        for p, view in zip(self.params, self._views):
            p.data = view
            setattr(p, FLAT_ATTR, self)
        mark(self.params, ParamStatus.AVAILABLE)

    def _lay_out_values(self, owned_view: torch.Tensor, master: MasterPolicy, trainable: bool) -> None:
        """Set ``shard``, ``master``, the master store and ``layout`` (``MasterLayout``: which of the seven, with its
        bytes) from this rank's owned values ``owned_view``."""
        sharded = self.stage.shards_parameters  # stage 3: parameters gathered around each use
        # ``shard``: this rank's low-precision values (what an all-gather sends). Stage 3 in low
        # precision keeps none (the gather casts the master) unless the master is split, whose
        # high halves are the shard. In fp32 the shard is the master.
        self.shard: torch.Tensor | None = None
        self.master: torch.Tensor | None = None  # the fp32 master tensor, when it exists whole
        if not trainable:  # frozen: the compute-dtype shard is all there is (read and written as the "master")
            if not sharded:
                raise ValueError(f"flat group {self.name}: frozen parameters are partitioned at stage 3 only, "
                                 f"not {int(self.stage)}")
            if master.quantize_frozen and not self.resident and self.compute_dtype.is_floating_point:
                self.master_store: MasterStore = quantized_comm.QuantizedShard(owned_view, self.ledger)
                self.layout = MasterLayout.FROZEN_CODES
            else:
                self.shard = owned_view if self.resident else self.ledger.empty(
                    self.shard_numel, self.compute_dtype, Category.PARAM, self.device).copy_(owned_view)
                self.master_store = FullMaster(self.shard, False)
                self.layout = MasterLayout.FROZEN
            self.master_param = torch.nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=self.device),
                                                   requires_grad=False)
        elif master.shared:
            if self.compute_dtype != torch.bfloat16:
                raise ValueError(f"shared-storage master weights need bf16 training, not {self.compute_dtype}")
            high = (self._own_copy(owned_view, self.shard_numel, self.compute_dtype) if sharded
                    else owned_view)
            self.shard = high
            low = self.ledger.zeros(self.owned_numel, torch.int16, Category.MASTER, self.device)
            if not sharded:  # the fp32 master would be 4 bytes per owned element; the residual is 2
                self.ledger.save("shared_master_weights", Category.MASTER, 2 * self.owned_numel)
            self.master_store = SharedMaster(high, low)
            self.layout = MasterLayout.SHARED
            placeholder = torch.empty(0, dtype=torch.float32, device=self.device)
            self.master_param = torch.nn.Parameter(placeholder, requires_grad=False)  # data swapped in by the step
        elif master.bf16_rounding is not None:
            if self.compute_dtype != torch.bfloat16:
                raise ValueError(f"bf16 master weights need bf16 training, not {self.compute_dtype}")
            self.shard = self._own_copy(owned_view, self.shard_numel, self.compute_dtype) if sharded else owned_view
            # the fp32 master there would be 4 bytes per owned element; at stage 3 the bf16 shard is 2 of them
            self.ledger.save("bf16_master_weights", Category.MASTER, (2 if sharded else 4) * self.owned_numel)
            self.master_store = Bf16Master(self.shard, master.bf16_rounding)
            self.layout = MasterLayout.BF16
            placeholder = torch.empty(0, dtype=torch.float32, device=self.device)
            self.master_param = torch.nn.Parameter(placeholder, requires_grad=False)  # data swapped in by the step
        else:
            if self.compute_dtype == torch.float32:  # no second copy: the fp32 shard is the master
                whole = (owned_view if not sharded or self.resident
                         else self._own_copy(owned_view, self.shard_numel, self.compute_dtype))
                self.shard = whole
                self.layout = MasterLayout.FP32_OWN if whole is not owned_view else MasterLayout.FP32_ALIAS
            else:
                if not sharded:
                    self.shard = owned_view
                whole = self._own_copy(owned_view, self.owned_numel, torch.float32)
                self.layout = MasterLayout.LOW_PRECISION
            self.master = whole
            self.master_store = FullMaster(whole, master.round_like_shared)
            self.master_param = torch.nn.Parameter(whole, requires_grad=False)
        if master.offload is not None and trainable:  # stage 3: the master shard is the parameter shard
            self.master_store = TieredMaster(self.master_store, master.offload.tier, self.ledger,
                                             master.offload.max_writes)
            self.shard = self.master = None
            self.layout = MasterLayout.TIERED
            placeholder = torch.empty(0, dtype=torch.float32, device=self.device)
            self.master_param = torch.nn.Parameter(placeholder, requires_grad=False)

    def attach(self, unit: Any, owner: Any, pool: BufferPool) -> None:
        """The unit holding this group, the partition (one engine's) holding that, and its pool of freed buffers."""
        self.unit, self.owner, self.pool = unit, owner, pool

    def forget_params(self) -> None:
        """The model's parameters are given back (``ZeroPartition.remove``): they no longer name this group.
        Their values stay what they hold."""
        for p in self.params:
            if getattr(p, FLAT_ATTR, None) is self:
                delattr(p, FLAT_ATTR)

    # -- stage-3 gather / release -----------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """The full buffer is allocated (``GATHERING`` or ``GATHERED``): read-only, ``Residency`` says which."""
        return self.residency is not Residency.RELEASED

    def gather(self, quantize: str | None = None, joined: Joined | None = None) -> Handle | None:
        """Start the all-gather of the shards into ``full``; ``None`` if already gathered. The parameters
        see the values from ``expose()`` on. ``quantize``: codes of that dtype on the wire
        (``all_gather_into_full``). ``joined``: where the gather is a plain all-gather of the shard over ``dp``,
        its ``(output, input)`` is added there under ``(dp, dtype)`` and ``None`` returned; the caller issues
        each entry as one collective (``Unit.start_gather``)."""
        if self.gathered:
            return None
        storage, nbytes = self.full.untyped_storage(), self.padded_numel * self.full.element_size()
        if not self.pool.take(storage, nbytes, Category.PARAM_GATHERED):
            storage.resize_(nbytes)
        self.ledger.resized(self.full)
        self.residency = Residency.GATHERING
        mark(self.params, ParamStatus.INFLIGHT)
        if joined is not None and self.join_gather(joined, quantize):
            return None
        return self.all_gather_into_full(quantize)

    def join_gather(self, joined: Joined, quantize: str | None = None) -> bool:
        """Where this group's gather (``all_gather_into_full``) is a plain all-gather of its shard over ``dp``,
        add it with its ``(output, input)`` to ``joined`` under ``(dp, dtype)`` and return True: the caller issues
        each entry as one collective (``units.issue_joined``). False (nothing added) for hpZ's secondary copy, qwZ's
        codes, a quantized store or MiCS's two-level gather."""
        if (self.values_group is not self.dp or self._secondary is not None or quantize is not None
                or isinstance(self.master_store, quantized_comm.QuantizedShard)):
            return False
        self.quantized = False
        joined.setdefault((self.dp, self.full.dtype), []).append((self, self._full_data, self._wire_source()))
        return True

    def _wire_source(self) -> torch.Tensor:
        """What this rank sends in a gather of its shard: the shard, or (stage 3, low precision) the master cast
        into a comm buffer for the wire only."""
        if self.shard is not None:
            return self.shard
        source = self.ledger.empty(self.shard_numel, self.compute_dtype, Category.COMM_BUFFER, self.device)
        self.master_store.to_compute(source)
        return source

    def expose(self) -> None:
        """Point every parameter at its view of the gathered buffer, once the gather has landed (``Unit``
        calls it after waiting): while the all-gather is in flight the parameters still read as released,
        never as a buffer another thread is writing (see note: released parameters)."""
        if self.gathered:
            for p, view in zip(self.params, self._views):
                p.data = view
            mark(self.params, ParamStatus.AVAILABLE)
            self.residency = Residency.GATHERED

    def all_gather_into_full(self, quantize: str | None = None, exact: bool = False) -> Handle:
        """All-gather every rank's low-precision shard into ``full`` (which must be allocated); under hpZ, while a
        secondary copy is held, its parts over the secondary group instead (the values it copied). ``quantize`` (qwZ,
        a floating-point group): the shards go as codes of that dtype (``quantized_comm.WEIGHT_DTYPES``: int8 or fp8
        with a scale per block, or bf16), and ``full`` holds their dequantized values on every rank. ``exact``: the
        shards as they are, over ``dp``, whatever the secondary copy holds. ``quantized`` says afterwards whether
        ``full`` holds dequantized values."""
        if self._secondary is not None and not exact:
            assert self.secondary_group is not None
            self.quantized = self._secondary_quantized
            return self.secondary_group.all_gather(self._full_data, self._secondary)
        if isinstance(self.master_store, quantized_comm.QuantizedShard):  # its codes are its values: never "quantized"
            self.quantized = False
            return quantized_comm.gather(self.values_group, self._full_data, self.master_store, self.ledger)
        source = self._wire_source()
        self.quantized = quantize is not None and not exact and self.full.is_floating_point()  # (packed storage: as is)
        if quantize is not None and self.quantized:
            return quantized_comm.gather(self.values_group, self._full_data, source, self.ledger, quantize)
        return self.values_group.all_gather(self._full_data, source)

    def make_exact(self) -> None:
        """qwZ: a group gathered with codes is gathered again exactly, in place (for a reader of the model's
        values: ``state_dict``, ``GatheredParameters``, ``destroy``). A collective where any group is; every rank's
        groups are alike."""
        if self.quantized and self.residency is Residency.GATHERED:
            self.all_gather_into_full(exact=True).wait()

    def release(self, keep_secondary: bool = False) -> None:
        """Free the gathered buffer (stage 3). Each parameter then holds an empty tensor of its dtype and
        device (shape ``(0,)``) until the next gather (see note: released parameters); the views autograd
        saved keep the buffer's storage object and read the values again once it is gathered.
        ``keep_secondary`` (a forward's release, under hpZ): this rank's part of the values over the secondary group
        is kept first, unless held already."""
        if self.residency is Residency.GATHERING:
            raise RuntimeError(f"{self.name}: released while its all-gather is in flight (wait for it and expose() "
                               f"first): the collective would write into a freed buffer")
        if self.gathered and not self.resident:
            if keep_secondary and self.secondary_group is not None and self._secondary is None:
                group = self.secondary_group
                part = self.padded_numel // group.size
                self._secondary = self.ledger.empty(part, self.full.dtype, Category.PARAM, self.device)
                self._secondary.copy_(self._full_data[group.rank * part:(group.rank + 1) * part])
                self._secondary_quantized = self.quantized
            if not self.pool.park(self.full, Category.PARAM_GATHERED):
                self.full.untyped_storage().resize_(0)
                self.ledger.resized(self.full)
            self.residency = Residency.RELEASED
            for p in self.params:
                p.data = self._released
            mark(self.params, ParamStatus.NOT_AVAILABLE)

    def drop_secondary(self) -> None:
        """hpZ: the values changed (a step, a load, a write) or the step is due: the secondary copy goes, and the next
        gather reads the shards over ``dp``."""
        self._secondary = None

    @property
    def secondary_numel(self) -> int:
        """Elements of the secondary copy held now (0: none)."""
        return 0 if self._secondary is None else self._secondary.numel()

    # -- the gradient's reductions and the parameters' gathers in flight -------------------------------
    def wait_pending(self) -> None:
        """Land everything in flight on this group: its gradient's reductions, then its parameters' gathers."""
        self.gradient.wait()
        if self.gathers:
            for handle in self.gathers:
                handle.wait()
            self.gathers.clear()

    def free_grads(self) -> None:
        """After the step: the gradient's stores let go (``GroupGrad.free``), the master's ``.grad`` too."""
        self.gradient.free()
        self.master_param.grad = None

    def _own_copy(self, values: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ledger-charged (``master``) copy of ``values`` in ``dtype``."""
        out = self.ledger.empty(numel, dtype, Category.MASTER, self.device)
        return out.copy_(values)

    # -- after the optimizer step -------------------------------------------------------------
    def master_to_params(self) -> bool:
        """Write the stepped master into the compute-dtype shard; whether the group is to be gathered now (stages
        1-2: ``gather_shard``, or joined with others, ``join_gather``)."""
        if self.stage.shards_parameters or self.shard is None:
            return False  # stage 3: the next gather reads the master (stages 1-2 always hold a shard)
        if self.layout is not MasterLayout.FP32_ALIAS:  # (an alias: the shard is the master, nothing to write)
            with torch.no_grad():
                self.master_store.to_compute(self.shard)
        return self.stage.gathers_after_step

    def gather_shard(self) -> Handle:
        """Stages 1-2: start the all-gather of every rank's shard into the parameters' buffer."""
        assert self.shard is not None
        return self.values_group.all_gather(self._full_data, self.shard)

    def gather_owned(self, owned: torch.Tensor) -> torch.Tensor:
        """The whole group-length tensor (``numel``, unpadded) from every rank's owned-range piece
        (the master, or an optimizer state); a collective at stages 1-3."""
        if not self.stage.partitions:
            return owned[:self.numel].clone()
        full = torch.empty(self.padded_numel, dtype=owned.dtype, device=self.device)
        self.dp.all_gather(full, owned).wait()
        return full[:self.numel]

    def gather_master(self) -> torch.Tensor:
        return self.gather_owned(self.master_store.read(0, self.owned_numel))

    def write_param(self, index: int, flat: torch.Tensor) -> None:
        """Write parameter ``index``'s whole values (``flat``, its elements in order) into the part of it this
        rank owns, through the master store (the gathered buffer is not touched: the caller re-gathers)."""
        off, n = self.offsets[index], self.numels[index]
        lo, hi = self.owned_start, self.owned_start + self.owned_numel
        start, end = max(off, lo), min(off + n, hi)
        self.drop_secondary()
        if start < end:
            with torch.no_grad():
                self.master_store.write(start - lo, flat[start - off:end - off])

    def step_gradient(self) -> torch.Tensor:
        """The gradient the step reads: the reduced one of the owned range (stages 1-3), else the whole flat one
        (stage 0), zeros where none arrived."""
        return self.gradient.ensure_reduced() if self.stage.partitions else self.gradient.ensure_flat()

    def step_gradient_views(self) -> list[torch.Tensor]:
        """One rank, or stage 0 (the owned range is the whole group): each parameter's view of ``step_gradient()``, in
        its shape."""
        flat = self.step_gradient()
        return [flat[off:off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def param_segments(self) -> list[tuple[int, int, int]]:
        """``(param_index, start, end)`` of each parameter inside this rank's owned range."""
        lo, hi = self.owned_start, self.owned_start + self.owned_numel
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            s, e = max(off, lo), min(off + n, hi)
            if s < e:
                out.append((i, s - lo, e - lo))
        return out


def wait_all(groups: list[FlatParamGroup]) -> None:
    """``wait_pending`` on each of ``groups`` that has anything in flight, in order (a group with nothing in flight,
    the usual case at one rank, costs one attribute test, not a call)."""
    for g in groups:
        if g.gathers or g.gradient.pending:
            g.wait_pending()
