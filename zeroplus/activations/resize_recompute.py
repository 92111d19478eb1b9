"""Resize-based recompute: drop a cheap module's output after forward, recompute it in backward.

For each chosen module (by class name, default every activation function whose backward keeps its input: GELU,
SiLU, Mish, Hugging Face's activation modules, one written out; with ``norms``, every module that normalises over
the last dimension; both found by what they compute, ``module_roles.py``; or by qualified-name pattern), and for
each call of their functional forms in the model's own forward code (``F.gelu``, ``F.silu``, ``F.mish``; with norms
``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``; seen through a ``TorchFunctionMode`` while the engine's
forward runs, the module running the call known from global forward hooks installed for that time): its output
``y`` is remembered with the inputs it was computed from (a functional call's "parent" is the module whose
forward made the call). When the module's parent finishes its forward, if autograd saved ``y`` for some consumer (e.g.
the next Linear), the parent does not return it and nothing else holds it (``_held_elsewhere``: a hook or
the model keeping ``y`` or a view of it, which could read it later), ``y``'s storage is resized to 0: the tensor object,
and every view autograd saved, stay, but hold no memory. When backward unpacks ``y`` for that consumer, the
module is run again on the same inputs (no grad, under the forward's autocast state) and the result copied into
the same storage,
just before the consumer's backward uses it. Recomputation is deterministic, so gradients are
bitwise identical to a run without it.

Memory: the bytes of every dropped output are not held from the parent's forward end until its
consumer's backward (the ledger's ``resize_recompute`` / ``activation``); during a recompute, one
output's worth of temporary. Once the last consumer has unpacked an output, the record lets go of
it and of its inputs, so backward frees them when autograd would. The inputs are not held extra: the chosen modules'
own backward saves them anyway (GELU, SiLU and the norms save their input). Outputs that share
storage with an input (in-place modules) are left alone, and so are outputs held elsewhere or written in place
before the parent ended (held until backward, as without the technique); an input written in place since its
forward makes the recompute raise rather than give other values. Nothing but autograd's saved aliases can
read a dropped output, and their unpack recomputes it first. Outputs of a recompute inside an
activation-checkpointing replay are not touched (only the engine's own forward is watched). The functional
watch (a mode over every torch call, and global module hooks) ends after the first backward if it recorded
nothing: the model calls the chosen modules, which their own hooks see (see note: idle modes).
A chosen norm written in several ops also keeps only its inputs: what its forward computed and autograd would keep
is claimed and recomputed in backward (``norm_internals.py``; see note: norms written out).
See note: resize recompute; see note: functional recompute; see note: held outputs; see note: modified in place
(docs/design-notes.md).
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import sys
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..eager import compiled_modules, eager
from ..ledger import Category, Ledger
from ..logs import log_rank0
from .choices import TechniqueChoice
from .module_roles import activates, keeps_intermediates, normalises
from .norm_internals import NormInternals, _Token
from .saved_tensors import storage_key

TECHNIQUE = "resize_recompute"
# the functional forms of the activation functions and of the norms (``functional``)
ACTIVATION_FUNCTIONS: tuple[Callable, ...] = (F.gelu, F.silu, F.mish)
NORM_FUNCTIONS: tuple[Callable, ...] = (F.layer_norm, F.rms_norm, F.group_norm)


def is_norm(module: torch.nn.Module) -> bool:
    """A normalisation layer, by what it computes rather than its class (``module_roles.normalises``: torch's norms,
    and any module whose forward normalises over the last dimension: Hugging Face's ``LlamaRMSNorm``, a
    ``LayerNorm`` a user writes out)."""
    return normalises(module)


class _Record:
    __slots__ = ("module", "args", "inputs", "output", "key", "nbytes", "packed", "unpacked", "released", "sources",
                 "chained", "versions", "autocast")

    def __init__(self, module: Callable, args: tuple, inputs: list[torch.Tensor], output: torch.Tensor,
                 key: int) -> None:
        self.module, self.args, self.inputs, self.output, self.key = module, args, inputs, output, key
        self.nbytes = output.untyped_storage().nbytes()
        self.versions = _versions(inputs, output)  # the output's and inputs' as computed
        self.autocast = _autocast_state(output.device)  # replayed by the recompute
        self.packed = self.unpacked = 0
        self.released = False
        self.sources: list[_Record] = []  # records whose output is one of ``args`` (norm -> activation)
        self.chained = 0  # references to ``output`` in the ``args`` of live records (``_held_elsewhere``)


_PLAIN = (torch.Tensor, int, float, bool, str, type(None))  # leaves: no tensor inside


def _tensors(args: Any) -> list[torch.Tensor]:
    """The tensors in ``args``: a tuple of tensors and numbers read as it is (the common case, once per record),
    anything else walked as a tree."""
    if type(args) is tuple and all(isinstance(a, _PLAIN) for a in args):
        return [a for a in args if isinstance(a, torch.Tensor)]
    return [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]


def _versions(inputs: list[torch.Tensor], output: torch.Tensor) -> tuple[int, ...]:
    return (output._version, *(a._version for a in inputs))


def _name(record: _Record) -> str:
    """The function or module class that computed ``record``'s output, for errors."""
    func = record.module.func if isinstance(record.module, functools.partial) else record.module
    return getattr(func, "__name__", None) or type(func).__name__


def _autocast_state(device: torch.device) -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Autocast as it is now for the CPU and ``device``'s type: a recompute runs in backward, where it may be
    off (a norm under CUDA autocast computes in fp32 from bf16 inputs; without it, in bf16)."""
    types = ["cpu"] + ([device.type] if device.type not in ("cpu", "meta") else [])
    return tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)


class _FunctionalCalls(TorchFunctionMode):
    """Hands each call of a chosen function to its owner with the output (the call itself runs as usual)."""

    def __init__(self, owner: "ResizeRecompute") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.owner.functions and not torch.compiler.is_compiling():  # (a compiled function's calls:
            # its graph keeps what it saves; see note: hook scope)
            self.owner._functional_output(func, args, kwargs, out)
        return out


class ResizeRecompute:
    lets_inner_hooks = True  # an output saved under inner hooks is not packed here, so not dropped: safe

    def __init__(self, model: torch.nn.Module, class_names: list[str] | None, name_patterns: list[str],
                 ledger: Ledger, norms: bool = False, functional: bool = False,
                 choice: TechniqueChoice | None = None, fused: set[int] | None = None) -> None:
        """Recompute the outputs of modules whose class is in ``class_names`` (None: every activation function whose
        backward keeps its input, ``module_roles.activates``), whose name matches one of
        ``name_patterns``, and with ``norms`` every normalisation layer (``is_norm``); with ``functional``
        also the outputs of ``ACTIVATION_FUNCTIONS`` (with ``norms``, ``NORM_FUNCTIONS`` too) called by the
        model's forward code outside those modules. ``choice``: the engine's (``choices.py``); on by default
        (``choice.by_default``), a model found compiled at a forward turns it off (``stood_down``, and the choice
        says so) rather than refusing, and so does the choice found off at a forward (the memory budget's: see
        note: recompute where it pays). ``fused``: the ids of the modules whose forward ``fused_ops`` replaced with
        a kernel; a norm among them keeps what its kernel keeps (``written_norms`` leaves it out: see note: norms
        written out)."""
        patterns = list(name_patterns)
        self.choice = choice
        self.by_default = choice is not None and choice.by_default
        self.stood_down = False
        self.model = model
        self.ledger = ledger
        self.targets: list[str] = []
        self.written_norms: list[str] = []  # the norms whose intermediates are claimed (``norm_internals.py``)
        self.functions = (ACTIVATION_FUNCTIONS + (NORM_FUNCTIONS if norms else ())) if functional else ()
        self._target_ids: set[int] = set()
        self._stack: list[torch.nn.Module] = []  # the modules whose forward is running, innermost last
        self._mode: _FunctionalCalls | None = None
        self._global_hooks: list[Any] = []
        self._records: dict[int, _Record] = {}
        self._pending: dict[int, list[_Record]] = {}
        self._active = False
        self._recomputing = False
        self._functional_seen = 0  # functional outputs recorded before the first backward ended
        self._decided = False  # whether the functional calls were looked for (see note: idle modes)
        self._handles = []
        self.internals = NormInternals(ledger, TECHNIQUE, self._restore_inputs, _autocast_state)
        parents: dict[int, torch.nn.Module] = {}
        for name, module in model.named_modules():
            chosen = ((activates(module) if class_names is None else type(module).__name__ in class_names)
                      or (norms and is_norm(module))
                      or any(fnmatch.fnmatchcase(name, p) for p in patterns))
            if not name or not chosen:
                continue
            parent = model.get_submodule(name.rpartition(".")[0])
            self.targets.append(name)
            self._target_ids.add(id(module))
            self._handles.append(module.register_forward_hook(eager(self._make_output_hook(parent))))
            parents[id(parent)] = parent
            if norms and id(module) not in (fused or ()) and keeps_intermediates(module):  # see note: norms written out
                self.written_norms.append(name)
                self._handles += [module.register_forward_pre_hook(eager(self._norm_begins)),
                                  module.register_forward_hook(eager(self._norm_ends), always_call=True)]
        for parent in parents.values():
            self._handles.append(parent.register_forward_hook(eager(self._parent_done)))

    # -- forward -------------------------------------------------------------------------------
    @property
    def watches_calls(self) -> bool:
        """Whether ``begin_forward`` enters the functional mode (see note: idle modes)."""
        return bool(self.functions) and not self.stood_down

    def begin_forward(self) -> None:
        if self.stood_down:
            return
        if self.choice is not None and not self.choice.on:
            self._stand_down()  # the budget found it keeps nothing off the peak (see note: recompute where it pays)
            return
        compiled = compiled_modules(self.model)
        if compiled and self.by_default:  # see note: recompute by default
            names = ", ".join(compiled[:4]) + (" ..." if len(compiled) > 4 else "")
            log_rank0("resize_recompute (on by default) is off from here: %s runs compiled", names)
            self._stand_down(f"off: {names} runs compiled")
            return
        if compiled:  # see note: compilation
            raise NotImplementedError(
                f"zeroplus.resize_recompute does not work with compiled modules ({', '.join(compiled[:4])}"
                f"{' ...' if len(compiled) > 4 else ''}): a compiled graph's backward reads the dropped outputs "
                f"before they are recomputed, so its gradients would be wrong. Turn resize_recompute off, or "
                f"do not compile (activation checkpointing and swap_attention work compiled)")
        self._active = True
        if self.functions:
            self._mode = _FunctionalCalls(self)
            self._mode.__enter__()
            self._global_hooks = [torch.nn.modules.module.register_module_forward_pre_hook(eager(self._enter)),
                                  torch.nn.modules.module.register_module_forward_hook(eager(self._leave))]

    def _stand_down(self, why: str | None = None) -> None:
        """Off for good, on by default: hooks removed, and the engine's choice says so (``why``, where it had not
        said so already)."""
        self.remove()
        self.stood_down = True
        if self.choice is not None and self.choice.on:
            self.choice.stand_down(why or "off")

    def end_forward(self) -> None:
        if self.stood_down:
            return
        self._active = False
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._global_hooks:
            h.remove()
        self._global_hooks = []
        self._stack.clear()
        for records in self._pending.values():  # chosen modules run outside their parent
            for record in records:
                if not record.packed:
                    self._records.pop(record.key, None)
                    self._forget(record)
        self._pending.clear()

    def _make_output_hook(self, parent: torch.nn.Module):
        parent_ref = weakref.ref(parent)

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if self._active and not self._recomputing:
                self._remember(module, args, output, id(parent_ref()))
        return hook

    def _remember(self, compute: Callable, args: tuple, output: Any, parent: int) -> None:
        """Record ``output`` = ``compute(*args)`` to drop when the module with identity ``parent`` ends its forward
        (not a tensor needing a gradient, or written in place over an input: left alone)."""
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        key = storage_key(output)
        inputs = _tensors(args)
        if any(storage_key(a) == key for a in inputs):
            return  # in place: the output is the input's storage
        record = _Record(compute, args, inputs, output, key)
        for a in inputs:
            source = self._records.get(storage_key(a))
            if source is not None and source.output is a:
                source.chained += 1
                record.sources.append(source)
        self._records[key] = record
        self._pending.setdefault(parent, []).append(record)

    def _norm_begins(self, module: torch.nn.Module, args: tuple) -> None:
        if self._active and not self._recomputing:
            self.internals.begin(module, args, _tensors(args))

    def _norm_ends(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.internals.end()

    def _restore_inputs(self, inputs: list[torch.Tensor]) -> None:
        for arg in inputs:
            source = self._records.get(storage_key(arg))
            if source is not None:
                self._restore(source)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(module)

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        if id(module) in self._pending:  # (its own hook, if it has one, then finds nothing left)
            self._parent_done(module, args, output)

    def _functional_output(self, func: Callable, args: tuple, kwargs: dict, output: Any) -> None:
        """A chosen function's call seen by the mode (only while the forward runs; a recompute runs inside the
        mode's handler, where the mode does not see it)."""
        if not self._stack or id(self._stack[-1]) in self._target_ids:
            return  # a chosen module's own call (``nn.GELU`` calls ``F.gelu``): its output hook records it
        self._functional_seen += 1
        self._remember(functools.partial(func, **kwargs), args, output, id(self._stack[-1]))

    def _parent_done(self, parent: torch.nn.Module, args: Any, output: Any) -> None:
        records = self._pending.pop(id(parent), [])
        kept = {storage_key(t) for t in _tensors(output if isinstance(output, tuple) else (output,))}
        for record in records:
            if (record.packed and record.key not in kept and not self._held_elsewhere(record)
                    and _versions(record.inputs, record.output) == record.versions):
                record.output.untyped_storage().resize_(0)
                record.released = True
                self.ledger.save(TECHNIQUE, Category.ACTIVATION, record.nbytes)
            elif not record.packed:
                del self._records[record.key]  # nothing saved it: it dies with the forward, as without us
                self._forget(record)

    @staticmethod
    def _forget(record: _Record) -> None:
        """``record`` is let go: its inputs no longer count as references its sources expect."""
        for source in record.sources:
            source.chained -= 1
        record.sources = []

    def _held_elsewhere(self, record: _Record) -> bool:
        """Whether something besides autograd (through the aliases ``pack`` made) and the records holds
        ``record``'s output when its parent's forward ends: the tensor itself (a hook or the model kept it) or
        another tensor over its storage (a view kept). A read of it after the forward would then find a
        storage of 0 bytes (a segmentation fault), so it is not dropped: held until backward, as without the
        technique. Counted, not guessed: the tensor's Python references (the record's, and each record whose
        inputs it is) and its storage's owners (the tensor and one alias per pack)."""
        out = record.output
        storage = out.untyped_storage()
        owners = torch._C._storage_Use_Count(storage._cdata) - 1  # (less ``storage``'s own)
        # getrefcount's own argument, ``out`` here and ``record.output``
        return sys.getrefcount(out) - 3 - record.chained > 0 or owners != 1 + record.packed

    # -- saved tensors -------------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any | None:
        if self.internals.current is not None:
            token = self.internals.claim(tensor)
            if token is not None:
                return token
        if not self._records:
            return None
        record = self._records.get(storage_key(tensor))
        if record is None:
            return None
        record.packed += 1
        return record, tensor.detach(), tensor._version

    def unpack(self, token: tuple[_Record, torch.Tensor, int] | _Token) -> torch.Tensor:
        if isinstance(token, _Token):
            return self.internals.unpack(token)
        record, alias, version = token
        if not record.released and alias._version != version:  # kept, then written (see note: modified in place)
            raise RuntimeError(f"a tensor of shape {tuple(alias.shape)} saved for backward was modified in place "
                               f"after the forward (version {version} -> {alias._version}); backward would use "
                               f"other values than the forward's")
        self._restore(record)
        record.unpacked += 1
        if record.unpacked == record.packed:  # its last consumer: let autograd free it as usual
            self._records.pop(record.key, None)
            del record.args, record.output  # (the record is done: drop its references)
            self._forget(record)
        return alias

    def _restore(self, record: _Record) -> None:
        if not record.released:
            return
        now = _versions(record.inputs, record.output)
        if now[1:] != record.versions[1:]:  # see note: modified in place
            raise RuntimeError(
                f"zeroplus.resize_recompute: an input of {_name(record)} was modified in place after its forward "
                f"(input versions {list(record.versions[1:])}, now {list(now[1:])}), so its dropped output cannot be "
                f"recomputed as it was computed; turn resize_recompute off for it (modules, names, functional) or "
                f"do not write its inputs in place")
        self._restore_inputs(record.inputs)  # a chosen module fed by another (norm -> act), or a view of its output
        self._recomputing = True
        try:
            with torch.no_grad(), contextlib.ExitStack() as stack:
                if _autocast_state(record.output.device) != record.autocast:  # (entering it costs per record)
                    for device_type, enabled, dtype in record.autocast:
                        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                value = record.module(*record.args)
        finally:
            self._recomputing = False
        if value.dtype != record.output.dtype or value.shape != record.output.shape:
            raise RuntimeError(
                f"zeroplus.resize_recompute: recomputing an output of {_name(record)} gave {value.dtype} "
                f"{tuple(value.shape)} where the forward gave {record.output.dtype} {tuple(record.output.shape)}; "
                f"turn resize_recompute off for it (modules, names, functional)")
        record.output.untyped_storage().resize_(record.nbytes)
        record.released = False
        self.ledger.unsave(TECHNIQUE, Category.ACTIVATION, record.nbytes)  # (held again from here)
        record.output.data.copy_(value)  # through .data: autograd's version counter is unchanged

    def end_backward(self) -> None:
        if not self._decided and self.functions:  # see note: idle modes
            self._decided = True
            if not self._functional_seen:
                self.functions = ()
                log_rank0("resize_recompute: the first step's forward called no %s outside the chosen modules; "
                          "not looked for from here (the call-watching mode costs per call)",
                          ", ".join(f.__name__ for f in ACTIVATION_FUNCTIONS + NORM_FUNCTIONS), level=logging.DEBUG)
        self.internals.end_backward()
        for record in self._records.values():
            if record.released:  # backward never needed it (e.g. a branch without gradient)
                self.ledger.unsave(TECHNIQUE, Category.ACTIVATION, record.nbytes)
        self._records.clear()
        self._pending.clear()

    def remove(self) -> None:
        for h in self._handles + self._global_hooks:
            h.remove()
        self._handles.clear()
