"""Adam and AdamW whose moments are stored in fewer bits than they are computed in.

``exp_avg`` and ``exp_avg_sq`` are each kept in fp32, bf16 or fp16 (``zeroplus.optimizer_states``, or DeepSpeed's
``bf16.bf16_optimizer_states``: both bf16). The step computes in fp32 exactly as torch's Adam/AdamW does: a run of
``CHUNK`` elements at a time, each stored moment is read into an fp32 temporary, the same kernel torch's optimizer
runs (the fused one where the group is fused, which takes the engine's ``grad_scale`` and ``found_inf`` as torch's
does: ``zero/kernel_scale.py``) updates the parameter and the temporaries, and the moments are stored back rounded.
Every element's update reads only that element, so a flat shard cut across parameters steps as each parameter
would whole: zeroplus at any stage equals the plain module with this optimizer bit for bit.
On the CPU, a fused group whose moments are fp32 or bf16, or both fp8 (or mxfp8), is stepped in one pass instead
(``kernels/native_adam.py``: one read and one write of each element, where the chunks make five passes; fp8 a block
at a time), with the same values bit for bit: the loop is checked against torch's kernel and the fp8 codec when it is
loaded, and the chunked step still takes each tensor's last few elements (torch's scalar loop's, and the block they
are in). Where the loop cannot be built or differs, the chunked step runs and the log says why. The fp8 second
moment's root is correctly rounded (``block_fp8.root_``: torch's CPU ``sqrt`` is within a unit in the last place).

Rounding: ``nearest`` (torch's cast, ties to even) or, for bf16 and fp8, ``stochastic``
(``kernels/stochastic_round.py``, ``kernels/block_fp8.py``: by a hash of the value and the step count, the same on any
layout); unset, stochastic where a moment is fp8 (to nearest, its 3 mantissa bits lose an average's small updates:
the main job's loss +3%).

Memory: ``state_bytes`` per element for the moments (4 with both bf16, against 8 in fp32) and, while a step runs, two
fp32 temporaries of ``CHUNK`` elements (8 MiB; stochastic rounding's hash 8 MiB more: ``workspace_bytes``; a few
elements where the one-pass loop steps the rest), which the memory budget adds to the step.
A step may be handed a flat parameter's gradient as segments instead of its ``.grad`` (``given``: one rank's kept
gradients, ``zero/direct_step.py``; see note: one-rank fp8 segments): the same values, read where they are.
Loading a state dict keeps the configured dtypes: moments saved in another dtype are converted (rounded to
nearest), where torch's ``load_state_dict`` would cast them to the parameter's dtype.
See note: stored optimizer states (docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any, Union

import torch
from torch.optim.adam import adam as _adam_functional

from ..cache_dir import cache_root
from ..kernels import native_adam
from ..kernels.block_fp8 import E4M3, E8M0, MX_BLOCK, blocks, dequantize_into, quantize, root_
from ..kernels.stochastic_round import store

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": E4M3, "mxfp8": E4M3}
BLOCKS = (128, 256)  # fp8's (fp32 scales); mxfp8's is MX_BLOCK (e8m0 scales)
MOMENTS = ("exp_avg", "exp_avg_sq")
CHUNK = 1 << 20  # elements per fp32 temporary
Gradient = Union[torch.Tensor, native_adam.GradientSegments]  # a step's gradient: one tensor, or one rank's segments
logger = logging.getLogger("zeroplus.optim")


class StoredStates(torch.optim.Optimizer):
    """The step of Adam/AdamW over moments kept in ``exp_avg_dtype`` and ``exp_avg_sq_dtype``; mixed into
    ``StoredStatesAdam`` and ``StoredStatesAdamW``."""

    decoupled: bool

    def __init__(self, params: Any, *, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, rounding: str = "nearest", block: int = 128,
                 scale_dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        check_group(kwargs)
        kwargs["foreach"] = False
        super().__init__(params, **kwargs)  # type: ignore[call-arg]
        self._store(exp_avg_dtype, exp_avg_sq_dtype, rounding, block, scale_dtype)

    def _store(self, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype, rounding: str, block: int,
               scale_dtype: torch.dtype) -> None:
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding {rounding!r}: 'nearest' or 'stochastic'")
        if (scale_dtype, block) != (E8M0, MX_BLOCK) and (scale_dtype != torch.float32 or block not in BLOCKS):
            raise ValueError(f"block {block!r} of {scale_dtype} scales: fp32 scales per {BLOCKS} elements, or e8m0 "
                             f"scales per {MX_BLOCK} (mxfp8)")
        self.state_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.rounding = rounding
        self.block = block  # fp8 moments: elements per scale
        self.scale_dtype = scale_dtype  # fp8 moments: their scales' (fp32, or mxfp8's e8m0)
        self._held: dict[torch.device, torch.Tensor] | None = None  # chunk buffers kept across calls: holding()
        # parameters whose gradient a ``given`` call hands the step (``native_adam.GradientSegments``), by parameter
        self._given: dict[torch.Tensor, native_adam.GradientSegments] = {}
        # whether gradients may come as segments (one rank: ``zero/direct_step.py``, set when the engine is
        # assembled): where the native loop does not read them, a chunk of them is gathered into one more row
        self.takes_gradient_segments = False
        self.native = self._native_kernel()

    def _native_kernel(self) -> native_adam.NativeAdam | None:
        """The one-pass CPU loop (``kernels/native_adam.py``) where it serves these moments and a parameter is on
        the CPU: built and checked against torch's kernel once per process; None elsewhere (the chunked step)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if not any(p.device.type == "cpu" and p.dtype == torch.float32 for p in params):
            return None
        return self._loop_here()

    def _loop_here(self) -> native_adam.NativeAdam | None:
        """The one-pass loop where it serves these moments' dtypes and builds on this machine, else None."""
        dtypes = set(self.state_dtypes.values())
        if not (dtypes <= set(native_adam.KINDS) or dtypes == {E4M3}):
            return None
        directory = os.path.join(cache_root(), "native")
        kernel = native_adam.load(directory)
        if kernel is None:
            logger.info("stored optimizer states: the chunked step (%s)", native_adam.unavailable(directory))
        return kernel

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the chunk buffers from one ``step()`` call to the next while inside: a caller that steps a shard
        chunk by chunk (``zero/chunked_step.py``) would otherwise have them made, faulted in and freed once per
        chunk. The bytes held are ``workspace_bytes``, as inside a single step."""
        self._held = {}
        try:
            yield
        finally:
            self._held = None

    @contextlib.contextmanager
    def given(self, grads: dict[torch.Tensor, native_adam.GradientSegments]) -> Iterator[None]:
        """Inside, ``step`` steps each parameter of ``grads`` (a flat one, with no ``.grad``) over that gradient, held
        as segments (one rank's kept gradients: ``zero/direct_step.py``): the values ``step`` gives with the segments
        gathered into its ``.grad``, bit for bit. The native loop reads them where they are; the chunked step
        (another device, or the last few elements) gathers a chunk at a time."""
        if not self.takes_gradient_segments:
            raise RuntimeError("stored optimizer states: gradients as segments, but takes_gradient_segments is not set")
        self._given = grads
        try:
            yield
        finally:
            self._given = {}

    @property
    def state_bytes(self) -> float:
        """Bytes per element of the stored moments (an fp8 moment's scales included: 4 bytes a block, 1 for mxfp8's)."""
        scale = self.scale_dtype.itemsize / self.block
        return sum(dtype.itemsize + (scale if dtype == E4M3 else 0) for dtype in self.state_dtypes.values())

    def state_nbytes(self, numel: int) -> int:
        """The moments' bytes for a tensor of ``numel`` elements as the ledger counts them: each moment's values and,
        fp8, its scales, each where it is more than one element (the ledger counts no one-element tensor)."""
        total = 0
        for dtype in self.state_dtypes.values():
            total += dtype.itemsize * numel if numel > 1 else 0
            if dtype == E4M3 and blocks(numel, self.block) > 1:
                total += self.scale_dtype.itemsize * blocks(numel, self.block)
        return total

    @property
    def block_scaled(self) -> bool:
        """Whether a moment is fp8 with a scale per block: its state is not one value per element (the one-rank
        per-parameter views, ``direct_step.py``, and the chunked and tiered steps cannot slice it)."""
        return E4M3 in self.state_dtypes.values()

    @property
    def workspace_bytes(self) -> int:
        """The temporaries a step holds at once: one fp32 chunk of each moment, and stochastic rounding's two int32
        chunks, a chunk as long as the longest run the chunked step takes where that is shorter than ``CHUNK`` (as
        ``step`` makes them: a small model's shards were predicted 8% over the main job's peak with whole chunks);
        where the native loop steps a parameter, the chunked step takes only its last few elements. An fp8 second
        moment's root is taken in double (``block_fp8.root_``): 8 bytes an element more while it is stored."""
        longest = max((self._chunked(p, group, p) for group in self.param_groups for p in group["params"]), default=0)
        return self._workspace(longest)

    def predicted_workspace_bytes(self, on_cpu: bool) -> int:
        """``workspace_bytes`` as the step holds it on the device a simulated step (on the meta device, unfused)
        stands in for, with its groups fused: on the CPU, where the one-pass loop serves these moments on this
        machine, only the last few elements of each parameter go through the chunked step; elsewhere all of them."""
        native = self._loop_here() if on_cpu else None
        params = [p for group in self.param_groups for p in group["params"]]
        chunked = [p.numel() if native is None else self._tail(native, p.numel()) for p in params]
        return self._workspace(max(chunked, default=0))

    def _workspace(self, longest: int) -> int:
        root = 8 if self.state_dtypes["exp_avg_sq"] == E4M3 else 0
        return (self._rows() * 4 + root) * min(CHUNK, longest)

    def _rows(self) -> int:
        """fp32 rows of the step's scratch: the two moments, stochastic rounding's two int32 rows of the hash, and
        a gathered gradient's where gradients may come as segments (its last row)."""
        return (4 if self.rounding == "stochastic" else 2) + int(self.takes_gradient_segments)

    def _native_for(self, p: torch.Tensor, group: dict[str, Any], grad: Gradient) -> bool:
        """Whether the native loop steps ``p`` (its group fused, as the loop is torch's fused kernel's arithmetic)."""
        return (self.native is not None and bool(group["fused"]) and p.device.type == "cpu"
                and native_adam.fits(p, grad))

    def _chunked(self, p: torch.Tensor, group: dict[str, Any], grad: Gradient) -> int:
        """How many of ``p``'s elements the chunked step takes: all, or the native loop's remainder."""
        n = p.numel()
        if self.native is None or not self._native_for(p, group, grad):
            return n
        return self._tail(self.native, n)

    def _tail(self, native: native_adam.NativeAdam, n: int) -> int:
        """The last elements of a tensor of ``n`` the native loop leaves to the chunked step (fp8: with their block)."""
        return n - (native.covered_blocks(n, self.block) if self.block_scaled else native.covered(n))

    def _state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if not state:  # as torch makes them (fused: the count on the parameter's device), in the stored dtypes
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if group["fused"] else "cpu")
            for key in MOMENTS:
                state[key] = torch.zeros(p.shape, dtype=self.state_dtypes[key], device=p.device)
                if self.state_dtypes[key] == E4M3:
                    state[f"{key}_scale"] = torch.ones(blocks(p.numel(), self.block), dtype=self.scale_dtype,
                                                       device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        stepped: list[tuple[torch.Tensor, dict[str, Any], Gradient]] = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = self._given.get(p, p.grad)
                if grad is not None:
                    stepped.append((p, group, grad))
        # an overflow step leaves everything as it is. Where the native loop is built (the CPU) the flag is read here
        # and nothing is stepped or stored: the states are made, as torch's step makes them, and left. Elsewhere the
        # chunked step's kernel reads the flag on the device and returns at once, and each moment is stored again
        # from its dequantized values: the same values, though an fp8 block whose largest code is 224 is stored
        # again at half its scale with twice its codes (the smallest scale that holds the block's largest value)
        if self.native is not None and found_inf is not None and found_inf.item():
            for p, group, _ in stepped:
                self._state(p, group)
            return loss
        native = self.native is not None
        sizes: dict[torch.device, int] = {}  # one set of chunk buffers per device, as long as its longest chunk
        for p, group, grad in stepped:
            chunked = self._chunked(p, group, grad) if native else p.numel()
            sizes[p.device] = max(sizes.get(p.device, 0), min(CHUNK, chunked))
        scratch = self._held if self._held is not None else {}
        for device, size in sizes.items():
            if device not in scratch or scratch[device].shape[1] < size:
                scratch[device] = torch.empty(self._rows(), size, dtype=torch.float32, device=device)
        for p, group, grad in stepped:
            self._step_one(p, group, grad, grad_scale, found_inf, scratch[p.device], native)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict[str, Any], grad: Gradient,
                  grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None, scratch: torch.Tensor,
                  native: bool) -> None:
        if isinstance(grad, torch.Tensor) and grad.is_sparse:
            raise RuntimeError("stored optimizer states: sparse gradients are not supported")
        state = self._state(p, group)
        count = state["step"]
        count += 1
        flat_p = p.view(-1)
        beta1, beta2 = group["betas"]
        done = 0
        if native and self._native_for(p, group, grad):
            assert self.native is not None
            hyper = {"lr": float(group["lr"]), "beta1": beta1, "beta2": beta2, "weight_decay": group["weight_decay"],
                     "eps": group["eps"], "count": float(count), "decoupled": self.decoupled,
                     "maximize": group["maximize"], "grad_scale": None if grad_scale is None else float(grad_scale),
                     "stochastic": self.rounding == "stochastic"}
            if self.block_scaled:
                flat_g = grad if isinstance(grad, native_adam.GradientSegments) else grad.view(-1)
                done = self.native.step_blocks(flat_p, flat_g, state["exp_avg"].view(-1), state["exp_avg_scale"],
                                               state["exp_avg_sq"].view(-1), state["exp_avg_sq_scale"],
                                               block=self.block, **hyper)
            else:
                assert isinstance(grad, torch.Tensor)  # (segments come with fp8 moments only: direct_step.py)
                done = self.native.step(flat_p, grad.view(-1), state["exp_avg"].view(-1),
                                        state["exp_avg_sq"].view(-1), **hyper)
        for a in range(done, p.numel(), CHUNK):  # (CHUNK is a multiple of every block: an fp8 block is in one chunk)
            b = min(a + CHUNK, p.numel())
            if isinstance(grad, native_adam.GradientSegments):
                g_ab = grad.gather(a, b, scratch[-1, :b - a])
            else:
                g_ab = grad.view(-1)[a:b]
            m = self._read(state, "exp_avg", a, b, scratch[0, :b - a])
            v = self._read(state, "exp_avg_sq", a, b, scratch[1, :b - a])
            if group["fused"]:
                kernel = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
                kernel([flat_p[a:b]], [g_ab], [m], [v], [], [count], amsgrad=False, lr=group["lr"],
                       beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                       maximize=group["maximize"], grad_scale=grad_scale, found_inf=found_inf)
            else:  # torch's own single-tensor step, which advances the count it is given: a copy per chunk
                if grad_scale is not None or found_inf is not None:
                    raise RuntimeError("stored optimizer states: grad_scale and found_inf need the fused kernel")
                _adam_functional([flat_p[a:b]], [g_ab], [m], [v], [], [count - 1], foreach=False,
                                 capturable=False, differentiable=False, fused=False, grad_scale=None,
                                 found_inf=None, has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2,
                                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                                 maximize=group["maximize"], decoupled_weight_decay=self.decoupled)
            work = scratch[2:4].view(torch.int32) if self.rounding == "stochastic" else None
            self._write(state, "exp_avg", a, b, m, count, work)
            self._write(state, "exp_avg_sq", a, b, v, count, work)
        if found_inf is not None:  # as torch's fused step: an overflow takes the count back
            count -= found_inf

    def _read(self, state: dict[str, Any], key: str, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[a, b)`` of a stored moment in fp32 (``out``); an fp8 second moment is kept as its square root
        (so it underflows where the first moment does, not at the square of that: ``block_fp8.py``)."""
        stored = state[key].view(-1)[a:b]
        if stored.dtype != E4M3:
            return out.copy_(stored)
        dequantize_into(out, stored, state[f"{key}_scale"][a // self.block:blocks(b, self.block)], self.block)
        return out.square_() if key == "exp_avg_sq" else out

    def _write(self, state: dict[str, Any], key: str, a: int, b: int, value: torch.Tensor, count: torch.Tensor,
               work: torch.Tensor | None) -> None:
        """``value`` (fp32, scratch afterwards) stored as elements ``[a, b)`` of a moment."""
        stored = state[key].view(-1)[a:b]
        if stored.dtype != E4M3:
            store(stored, value, self.rounding, count, work)
            return
        quantize(root_(value) if key == "exp_avg_sq" else value, stored,
                 state[f"{key}_scale"][a // self.block:blocks(b, self.block)], self.block,
                 count if self.rounding == "stochastic" else None, work)

    def per_element(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with each fp8 moment as one bf16 value per element, its scales gone: what a checkpoint saves
        and slices (exact: ``block_fp8.py``; the second moment squared, at most 8 significant bits)."""
        if not self.block_scaled or not state:
            return state
        out = {k: v for k, v in state.items() if not k.endswith("_scale")}
        for key in MOMENTS:
            if self.state_dtypes[key] == E4M3:
                whole = self._read(state, key, 0, state[key].numel(), torch.empty(state[key].numel(),
                                                                                  device=state[key].device))
                out[key] = whole.to(torch.bfloat16)
        return out

    def from_per_element(self, state: dict[str, Any]) -> dict[str, Any]:
        """The stored form of ``state`` whose fp8 moments are one value per element (``per_element``'s, or any
        dtype): quantized with this rank's blocks (the same values where the blocks are those it was saved with)."""
        if not self.block_scaled:
            return state
        out = dict(state)
        for key in MOMENTS:
            given = state.get(key)
            if self.state_dtypes[key] != E4M3 or given is None or given.dtype == E4M3:
                continue
            n = given.numel()
            out[key] = torch.empty(n, dtype=E4M3, device=given.device)
            out[f"{key}_scale"] = torch.empty(blocks(n, self.block), dtype=self.scale_dtype, device=given.device)
            value = given.reshape(-1).to(torch.float32, copy=True)  # (scratch of _write: the given state stays)
            self._write(out, key, 0, n, value, torch.zeros(()), None)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p, state in list(self.state.items()):  # torch cast the moments to the parameter's dtype: back to ours
            for key in MOMENTS:
                wanted = self.state_dtypes[key]
                if key not in state or state[key].dtype == wanted:
                    continue
                if wanted == E4M3 and f"{key}_scale" in state:  # stored form: values and scales cast exactly to fp32
                    state[key] = state[key].to(E4M3)
                    state[f"{key}_scale"] = state[f"{key}_scale"].to(self.scale_dtype)
                elif wanted != E4M3:
                    state[key] = state[key].to(wanted)
            self.state[p] = self.from_per_element(state)


class StoredStatesAdam(StoredStates, torch.optim.Adam):
    decoupled = False


class StoredStatesAdamW(StoredStates, torch.optim.AdamW):
    decoupled = True


def state_dtype(optimizer: torch.optim.Optimizer, key: str, saved: torch.dtype) -> torch.dtype:
    """The dtype a per-element state saved in ``saved`` is loaded into: a stored moment's configured dtype, any other
    floating state fp32 (the masters', as torch's ``load_state_dict`` casts to the parameter's), else as saved."""
    if isinstance(optimizer, StoredStates) and key in optimizer.state_dtypes:  # fp8: as ``per_element`` gives it
        return torch.bfloat16 if optimizer.state_dtypes[key] == E4M3 else optimizer.state_dtypes[key]
    return torch.float32 if saved.is_floating_point else saved


def requested(exp_avg: str | None, exp_avg_sq: str | None, rounding: str | None,
              bf16_optimizer_states: bool, block: int | None = None) -> dict[str, Any] | None:
    """The stored-states keyword arguments a config asks for (``zeroplus.optimizer_states``; an unset dtype is bf16
    where DeepSpeed's ``bf16.bf16_optimizer_states`` is true, else fp32), or None where both moments stay fp32.
    ``block``: the config's ``block`` where it sets one (fp8: 128 unset; mxfp8's is 32, and another is refused)."""
    default = "bf16" if bf16_optimizer_states else "fp32"
    names = {"exp_avg": exp_avg or default, "exp_avg_sq": exp_avg_sq or default}
    if names == {"exp_avg": "fp32", "exp_avg_sq": "fp32"}:
        return None
    scaled = {name for name in names.values() if name in ("fp8", "mxfp8")}
    rounding = rounding or ("stochastic" if scaled else "nearest")
    if rounding == "stochastic" and "fp16" in names.values():
        raise ValueError(f"config key 'zeroplus.optimizer_states.rounding' is 'stochastic', which is served for bf16 "
                         f"and fp8 moments only, and the moments are {names}")
    if scaled == {"fp8", "mxfp8"}:
        raise ValueError(f"config key 'zeroplus.optimizer_states' stores one moment in fp8 and the other in mxfp8 "
                         f"({names}): one block format serves both; give both fp8 or both mxfp8")
    if "mxfp8" in scaled and block is not None:
        raise ValueError(f"config key 'zeroplus.optimizer_states.block' is {block}, and mxfp8 moments have a scale "
                         f"per {MX_BLOCK} elements (the MX format's); leave 'block' unset or use fp8")
    return {"exp_avg_dtype": DTYPES[names["exp_avg"]], "exp_avg_sq_dtype": DTYPES[names["exp_avg_sq"]],
            "rounding": rounding, "block": MX_BLOCK if "mxfp8" in scaled else (block or 128),
            "scale_dtype": E8M0 if "mxfp8" in scaled else torch.float32}


def check_group(group: dict[str, Any]) -> None:
    """ValueError where a param group (or constructor arguments) asks for what the stored-states step does not run."""
    if group.get("amsgrad") or group.get("differentiable") or group.get("capturable"):
        raise ValueError("stored optimizer states: amsgrad, differentiable and capturable are not supported")


def adoptable(optimizer: torch.optim.Optimizer) -> type[StoredStates]:
    """The stored-states class ``adopt`` would make ``optimizer``; ValueError for another class or a param group it
    cannot step (nothing is changed)."""
    cls = stored_states_class(type(optimizer))
    for group in optimizer.param_groups:
        check_group(group)
    return cls


def adopt(optimizer: torch.optim.Optimizer, states: dict[str, Any]) -> StoredStates:
    """A client's torch ``Adam`` or ``AdamW`` made, in place, its stored-states counterpart with ``states``
    (``requested``'s arguments): the same object, so a scheduler bound to it still sets its learning rates and a
    caller holding it steps it; its param groups and hyper-parameters as they are, its loop kernel the per-chunk one
    (``foreach`` off, as the class's own constructor sets). ValueError for another class or what it cannot store."""
    cls = adoptable(optimizer)
    optimizer.__class__ = cls
    optimizer._patch_step_function()  # (torch's step hooks, on the class: a user's registered hooks still run)
    if "step" in vars(optimizer):  # a scheduler's wrapper of the former class's step, which it tracks calls by
        optimizer.step = _tracked_step(optimizer)  # type: ignore[method-assign]
    for group in (optimizer.defaults, *optimizer.param_groups):
        group["foreach"] = False
    adopted: StoredStates = optimizer  # type: ignore[assignment]
    adopted._store(**states)
    return adopted


def _tracked_step(optimizer: torch.optim.Optimizer) -> Any:
    """The adopted class's step, marking each call as torch's learning-rate schedulers' wrapper does (their
    ``_opt_called``, which a scheduler stepped before its optimizer warns by); held weakly, as theirs is."""
    held = weakref.ref(optimizer)
    own = type(optimizer).step

    def step(*args: Any, **kwargs: Any) -> Any:
        opt = held()
        assert opt is not None  # (called through the optimizer, which holds this)
        opt._opt_called = True  # type: ignore[attr-defined]
        return own(opt, *args, **kwargs)
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return step


def stored_states_class(cls: type[torch.optim.Optimizer]) -> type[StoredStates]:
    """The stored-states counterpart of torch's ``Adam`` or ``AdamW``; ValueError for any other class."""
    if cls is torch.optim.AdamW:
        return StoredStatesAdamW
    if cls is torch.optim.Adam:
        return StoredStatesAdam
    raise ValueError(f"{cls.__name__} keeps its states in fp32 only: stored optimizer state dtypes are served for "
                     f"Adam and AdamW")
