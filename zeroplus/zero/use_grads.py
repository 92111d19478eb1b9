"""Per-use gradients: a use's gradient goes into the flat gradient buffer as soon as it is computed.

Two cases where autograd's own accumulation holds more than one parameter-sized gradient:

- **Tied parameters** (a word embedding tied to the LM head). A parameter has one gradient
  accumulator, which runs only after every use's gradient has arrived: the head's gradient,
  computed first in backward, is held whole in autograd's input buffer until the embedding's
  arrives at the very end, and the two are summed into a third tensor before the engine sees it.
  Every module holding a tied parameter gets, for the length of its forward,
  ``AddIntoFlatGrad(param)`` in the parameter's place: an identity whose backward adds the
  gradient it receives into the parameter's slice of the flat buffer and passes nothing on.
- **Embeddings** (a module looking up rows of a tied parameter or one of the root unit's: a plain
  ``nn.Embedding``, or any module whose forward is one embedding or indexing operation on its weight,
  recognised by what it computes: ``lookup``).
  Its backward writes a dense gradient of the whole table (zeros except the rows the batch used)
  that is then added into the flat buffer. Here the embedding runs on the detached weight and
  ``EmbeddingRowsIntoFlat`` hands, in backward, the summed gradient of each distinct token to the
  partition, which adds it into its row of the flat buffer (stages 0-1) or reduces the rows
  sparsely (stages 2-3, ``row_reduce.py``): no table-sized temporary at all.

Memory (a parameter of ``n`` elements, ``c`` bytes): a tied parameter holds at most one use's
gradient (c * n) beside the flat buffer, instead of up to three (the held use, the arriving one
and their sum); an embedding's backward holds ``(T + 1) * d`` fp32 sums (T token positions of the
micro-batch: one row per position, so no size is read back from the device, ``per_token_sums``)
instead of c * n. Values: the flat buffer receives the uses in autograd's order,
``0 + g_head + g_emb``, the same sum autograd forms, and an fp32 embedding's per-token sums are
formed in the order the dense backward adds the rows (checked bitwise on CPU). In bf16/fp16 the
per-token sums are formed in fp32 and rounded once, where the CPU's dense 16-bit backward rounds
differently: equal within 16-bit rounding, not bitwise. In fp32, bitwise equal to autograd's
accumulation when the buffer starts at zero; with micro-batches accumulated in the
buffer, ``(acc + g1) + g2`` instead of ``acc + (g1 + g2)``: within one rounding per use.

At one rank in fp32 (every group keeping autograd's gradients, ``kept_grads.py``) the sinks add into the
parameter's kept gradient instead of a flat buffer: the first dense use's gradient is kept as it came, the rest
and the rows are added into it, the same sums (see note: one-rank tied uses). Where such a group takes its
gradients from ``.grad`` when the backward ends (no hook), only the embedding is routed (``UseSinks.dense``
None): the other uses reach autograd's accumulator as in the plain module (the first use's gradient becomes
``.grad`` as made, later ones are added in place: no more than the sink holds) and ``rows_into_grad`` adds the
rows into ``.grad`` (see note: one-rank tied rows).

The embeddings' rows are a memory technique the engine chooses (``zeroplus.embedding_rows``, read at each forward
through its ``TechniqueChoice``): off, an embedding is a dense holder like any other (``AddIntoFlatGrad``, its dense
table-sized gradient added into the flat buffer as one more counted use), or, where the parameter's dense uses are left
to autograd, it runs on the parameter itself, as in the plain module.

A group holding such a parameter cannot count its gradients to know when they are all in (a
module may run any number of times): it is reduced when the backward ends (``partition.py``),
which for the root unit is when its last gradient arrives anyway. Uses outside a holding module
(``F.linear(x, self.wte.weight)`` in a parent's forward) still reach the parameter's
accumulator and its hook, which adds them the same way.
See note: per-use gradients (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..activations.choices import TechniqueChoice
from ..eager import eager, in_backward

DenseSink = Callable[[torch.Tensor], None]
RowSink = Callable[[torch.Tensor, torch.Tensor, int], None]  # (distinct ids, summed gradient per id, tokens)


@dataclasses.dataclass
class UseSinks:
    """Where one parameter's use gradients go: ``dense(grad)`` for any use (None: holders other than an
    embedding are left alone, their uses reach the parameter's own accumulator), ``rows(ids, sums)`` for
    an embedding's distinct tokens; ``made()`` is told, in forward, of each routed dense use whose gradient
    will come back (not of uses replayed inside backward)."""

    dense: DenseSink | None
    rows: RowSink
    made: Callable[[], None]


class AddIntoFlatGrad(torch.autograd.Function):
    """Identity in forward; backward hands the gradient to ``sink`` and returns none."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, sink: DenseSink) -> torch.Tensor:
        ctx.sink = sink
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.sink(grad)
        return None, None


class EmbeddingRowsIntoFlat(torch.autograd.Function):
    """Identity on an embedding's output (computed from the detached weight); backward sums the
    output gradient per distinct token (skipping ``padding_idx``) and hands the sums to ``sink``.
    ``anchor``, passed only so that the backward runs (the output needs an input requiring gradients): the
    weight, whose accumulator then waits for the rows; with ``rows_into_grad``, which needs the accumulator to
    run first, an empty tensor of its own (not the output made to require gradients: autograd would hold the
    output, tokens x hidden, until the backward)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, anchor: torch.Tensor, ids: torch.Tensor,
                padding_idx: int | None, sink: RowSink) -> torch.Tensor:
        ctx.sink, ctx.padding_idx = sink, padding_idx
        ctx.save_for_backward(ids)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        (ids,) = ctx.saved_tensors
        # (the memory simulation's ids may be real while the gradient is on the meta device)
        flat_ids, rows = ids.reshape(-1).to(grad.device), grad.reshape(-1, grad.shape[-1])
        # fp32: the dense backward's own order and precision (bitwise equal); 16-bit: summed in fp32, rounded once
        # (the dense backward rounds differently; within its rounding). The same sizes on the meta device.
        distinct, sums = per_token_sums(flat_ids, rows, ctx.padding_idx)
        ctx.sink(distinct, sums if grad.dtype == torch.float32 else sums.to(grad.dtype), flat_ids.numel())
        return None, None, None, None, None  # the output came from the detached weight: nothing flows on


def per_token_sums(ids: torch.Tensor, rows: torch.Tensor, padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, sums)``, one row per token position (T = ``ids.numel()``): each distinct id at the row of its first
    place in sorted order, with the fp32 sum of its ``rows`` added in position order (the order the dense backward
    adds them); the other rows id 0 and zero sums (``padding_idx``'s rows are dropped: its tokens get no gradient).
    Fixed sizes, so nothing is read on the host (``unique`` and boolean indexing read a count back on an
    accelerator: a sync); adding a zero row into row 0 changes nothing."""
    t = ids.numel()
    at = torch.searchsorted(ids.sort().values, ids)  # each position's row: its id's first place in sorted order
    if padding_idx is not None:
        at.masked_fill_(ids == padding_idx, t)  # into a last row, cut off below
    distinct = torch.zeros(t + 1, dtype=ids.dtype, device=ids.device).scatter_(0, at, ids)
    sums = torch.zeros(t + 1, rows.shape[-1], dtype=torch.float32, device=rows.device)
    sums.index_add_(0, at, rows if rows.dtype == torch.float32 else rows.float())
    return distinct[:t], sums[:t]


def rows_into_grad(param: torch.Tensor) -> RowSink:
    """A row sink adding an embedding's per-token sums into ``param.grad`` in place (zeros first if it has none):
    what autograd's accumulator would have added, the dense gradient's rows, without the table-sized temporary.
    For a group that takes its gradients from ``.grad`` when the backward ends (one rank). A ``.grad`` made here
    is counted with the rest when it is taken. See note: one-rank tied rows."""
    def sink(ids: torch.Tensor, sums: torch.Tensor, tokens: int) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        param.grad.index_add_(0, ids, sums)
    return sink


def holders(model: torch.nn.Module, params: set[int]) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """``id(param) -> [(module, attribute name), ...]`` for every module holding one of ``params``
    directly, each (module, name) once."""
    out: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in params:
                out.setdefault(id(p), []).append((module, name))
    return out


def tied(model: torch.nn.Module) -> set[int]:
    """``id`` of every trainable parameter held by more than one (module, name)."""
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    return {pid for pid, where in holders(model, trainable).items() if len(where) > 1}


@dataclasses.dataclass(frozen=True)
class Lookup:
    """A module whose forward, given token ids, returns its parameter's rows for them and nothing else."""
    padding_idx: int | None  # the rows that get no gradient (an embedding's padding index)


_LOOKUPS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Lookup | None]] = weakref.WeakKeyDictionary()


def lookup(module: torch.nn.Module, name: str) -> Lookup | None:
    """Whether ``module`` is an embedding lookup of its parameter ``name``, by what it computes rather than its
    class: an ``nn.Embedding`` whose forward is torch's, without max_norm, sparse gradients or frequency scaling;
    or any module whose forward, called with a row of token ids, runs exactly one operation, torch's embedding
    (same conditions) or an indexing of the parameter by the ids (``self.weight[ids]``), and returns its result (a
    GPT written with its own module classes). Found once per module, on the meta device (no values read, nothing
    allocated), and kept: the answer must not change once the parameter is partitioned."""
    known = _LOOKUPS.setdefault(module, {})
    if name not in known:
        known[name] = _lookup(module, name)
    return known[name]


def _lookup(module: torch.nn.Module, name: str) -> Lookup | None:
    if isinstance(module, torch.nn.Embedding) and type(module).forward is torch.nn.Embedding.forward:
        plain = name == "weight" and module.max_norm is None and not module.sparse and not module.scale_grad_by_freq
        return Lookup(module.padding_idx) if plain else None
    param = module._parameters.get(name)
    if param is None or param.dim() != 2 or param.numel() == 0 or len(module._parameters) != 1:
        return None
    return _probe(module, name, param)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def _probe(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> Lookup | None:
    """Run ``module``'s own forward (no hooks) once on the meta device with two token ids, the parameter swapped for
    a meta tensor of its shape; a lookup runs one embedding or indexing operation on them and returns its result."""
    stand_in = torch.empty(param.shape, dtype=param.dtype, device="meta")
    ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
    module._parameters[name] = stand_in  # type: ignore[assignment]
    try:
        with torch.no_grad(), _Ops() as ops:
            out = type(module).forward(module, ids)
    except Exception:  # noqa: BLE001 - a module that does not take ids alone is no lookup
        return None
    finally:
        module._parameters[name] = param
    aten = torch.ops.aten
    if len(ops.calls) != 1 or not isinstance(out, torch.Tensor) or out.shape != (1, 2, param.shape[1]):
        return None
    func, args, kwargs, result = ops.calls[0]
    if result is not out or not args or args[0] is not stand_in:
        return None
    if func is aten.embedding.default and args[1] is ids:
        padding, by_freq, sparse = (list(args[2:]) + [-1, False, False][len(args) - 2:])[:3]
        if kwargs or by_freq or sparse:
            return None
        return Lookup(None if padding < 0 else int(padding))
    if func is aten.index.Tensor and len(args[1]) == 1 and args[1][0] is ids:
        return Lookup(None)
    return None


def routed(model: torch.nn.Module, flat: set[int], root: set[int]) -> set[int]:
    """Which parameters take the per-use path: the tied ones among ``flat`` (all in flat groups) and
    plain embeddings' weights among ``root`` (the root unit's: reduced at the end of backward anyway)."""
    out = tied(model) & flat
    for pid, where in holders(model, root).items():
        if all(lookup(m, n) is not None for m, n in where):
            out.add(pid)
    return out


class UseGrads:
    """Forward hooks on every module holding a routed parameter (``sinks``: ``id(param) ->
    UseSinks``). A plain embedding runs on the detached weight and its output is wrapped in
    ``EmbeddingRowsIntoFlat``; any other holder sees ``AddIntoFlatGrad(param)`` in the parameter's
    place. Everything is put back after the forward, also when it raises."""

    def __init__(self, model: torch.nn.Module, sinks: dict[int, UseSinks],
                 on_replay: Callable[[], None] = lambda: None, rows: TechniqueChoice | None = None) -> None:
        """``on_replay``: told when a holder's forward runs inside backward (an activation-checkpoint replay).
        ``rows``: whether embeddings send rows (``zeroplus.embedding_rows``), read at each forward; where it is off
        an embedding is a dense use like any other holder (``AddIntoFlatGrad``, counted), or, where the parameter's
        dense uses are left to autograd (``UseSinks.dense`` None), runs on the parameter itself. None: always on."""
        self._handles: list[Any] = []
        # With rows off, an embedding whose parameter leaves its dense uses to autograd does nothing in its hooks
        # but tell ``on_replay``, which matters only where a dense use is routed (no sink with ``dense``: none is);
        # then its hooks go when rows stand down, for good (about 20 us a forward on the one-rank stand-in).
        # See note: one-rank hooks.
        idle_without_rows = isinstance(rows, TechniqueChoice) and all(s.dense is None for s in sinks.values())
        idle: list[Any] = []
        by_module: dict[int, tuple[torch.nn.Module, list[str]]] = {}
        for where in holders(model, set(sinks)).values():
            for module, name in where:
                by_module.setdefault(id(module), (module, []))[1].append(name)
        self.row_receivers: set[int] = set()  # parameters some plain embedding sends rows for
        for module, names in by_module.values():
            found = lookup(module, names[0]) if len(names) == 1 else None
            embedding = found is not None
            if not embedding:  # (the parameters whose dense uses are left to autograd: not swapped)
                names = [n for n in names if sinks[id(module._parameters[n])].dense is not None]
                if not names:
                    continue
            if embedding:
                self.row_receivers.add(id(module._parameters[names[0]]))
            swap_in = eager(self._swap_in(names, sinks, (True if rows is None else rows) if embedding else False,
                                          on_replay))  # (a dense holder: never rows)
            swap_out = eager(self._swap_out(sinks, found))
            handles = [module.register_forward_pre_hook(swap_in),
                       module.register_forward_hook(swap_out, always_call=True)]
            self._handles += handles
            if embedding and idle_without_rows:
                idle += handles
        if idle:
            assert isinstance(rows, TechniqueChoice)
            rows.when_off(functools.partial(self._drop, idle))

    @staticmethod
    def _swap_in(names: list[str], sinks: dict[int, UseSinks], rows: TechniqueChoice | bool,
                 on_replay: Callable[[], None]):
        """``rows``: whether the module, an embedding, sends rows: a choice read at each forward, or True (always);
        False: a dense holder."""
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            replay = in_backward()
            if replay:
                on_replay()
            by_rows = rows.on if isinstance(rows, TechniqueChoice) else rows
            saved = {}
            for name in names:
                param = module._parameters[name]
                if param is None or id(param) not in sinks or not param.requires_grad:
                    continue
                if not by_rows and sinks[id(param)].dense is None:  # its uses left to autograd: this one too
                    continue
                saved[name] = param
                if by_rows:
                    module._parameters[name] = param.detach()  # type: ignore[assignment]
                    continue
                module._parameters[name] = AddIntoFlatGrad.apply(param, sinks[id(param)].dense)  # type: ignore[arg-type]
                if not replay:  # a checkpoint replay's uses were not counted in the forward
                    sinks[id(param)].made()
            ids = args[0] if by_rows and args else None
            stack = module.__dict__.setdefault("_zeroplus_use_saved", [])  # a stack: forwards nest
            stack.append((saved, ids, by_rows))
        return hook

    @staticmethod
    def _swap_out(sinks: dict[int, UseSinks], found: Lookup | None):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            stack = module.__dict__.get("_zeroplus_use_saved")
            if not stack:  # the forward ran without gradients: nothing was swapped
                return None
            saved, ids, by_rows = stack.pop()
            for name, param in saved.items():
                module._parameters[name] = param
            if found is not None and saved and by_rows and isinstance(output, torch.Tensor):
                (param,) = saved.values()
                sink = sinks[id(param)]
                anchor = param if sink.dense is not None else output.new_empty(0).requires_grad_()
                return EmbeddingRowsIntoFlat.apply(output, anchor, ids, found.padding_idx, sink.rows)
            return None
        return hook

    def _drop(self, handles: list[Any]) -> None:
        """Remove ``handles`` (hooks with nothing left to do), if still here."""
        for h in handles:
            if h in self._handles:
                h.remove()
                self._handles.remove(h)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
