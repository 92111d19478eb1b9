"""AutoTP: a Hugging Face causal LM split over the tensor group by its own tensor-parallel plan.

``"tensor_parallel": {"autotp_size": T}`` (DeepSpeed's key; or ``zeroplus.parallel.tensor``) on a model that has
no tensor-parallel layer of zeroplus's and that has a plan (Transformers' ``model.tp_plan``: the config's
``base_model_tp_plan`` with the head and input embeddings added; or the config's plan alone): each entry, from
the weights the model holds, becomes

- ``colwise``: a ``ColumnParallelLinear`` (this rank's rows of the weight and bias: its heads of
  ``q_proj``/``k_proj``/``v_proj``, its slice of ``gate_proj``/``up_proj``). Key/value heads fewer than T (T a
  multiple of their count): ``ReplicatedRowsLinear``, the whole projection on every rank, each computing the head
  its query heads read, and the attention's ``num_key_value_groups`` set to this rank's query heads per key/value
  head. Transformers' attention reshapes by ``head_dim``, so this rank's heads attend as the whole model's would;
- ``rowwise``: a ``RowParallelLinear`` (its columns of ``o_proj``/``down_proj``, the partial outputs all-reduced);
  ``rowwise_split_input`` (Olmo2's, GLM-4's ``o_proj``, after an attention each rank runs whole because its
  projections gather their outputs for a norm over all heads): the same, taking its part of the whole input, the
  parts' gradients gathered back;
- ``mla_kv_a_proj`` (DeepSeek-V2's latent ``kv_a_proj_with_mqa``): whole on every rank; the gradient of its rotary
  part (the config's ``qk_rope_head_dim`` last outputs, read by this rank's heads only) summed over the tensor group,
  as its latent part's already is by ``kv_b_proj``'s split;
- ``colwise_gather_output`` (the head): this rank's vocabulary rows, the logits all-gathered for the model's loss;
- ``embedding_rowwise``: a ``VocabParallelEmbedding`` (this rank's vocabulary rows, the lookups all-reduced); a head
  tied to it shares its slice, so the tie holds;
- ``moe_tp_experts`` (Mixtral's, Qwen3-MoE's, Llama 4's experts, their 3-D weights named by parameter): a weight
  ``colwise`` or ``packed_colwise`` is cut along its second-to-last dimension, ``rowwise`` or ``packed_rowwise``
  along its last, as Transformers cuts them whichever way the module multiplies (Mixtral's ``gate_up_proj``
  ``(experts, 2 I, H)`` by rows, Llama 4's ``(experts, H, 2 I)`` by columns); a packed cut takes its share of the
  gate's part and of the up projection's each, so the experts' own ``chunk(2)`` still parts them; the experts'
  inputs' gradients and their output summed over the tensor group; the router whole;
- ``local_params`` (Granite-SWA's attention): its own parameters named by the plan are cut as it names them (the
  attention sinks, one per head, ``colwise``: this rank's heads'), the module otherwise as it is;
- ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm``/``k_norm``): whole, each rank's gradient (from its
  own heads) summed over the tensor group by a hook on the parameter.

Everything else (norms, the router) stays whole on every rank; the gradient norm counts it once
(``tensor_layers.is_tensor_parallel``). ZeRO shards over the data group beside it. Refused before anything changes,
naming the key, the rank and what does not split: a style not listed, a module of another kind than the style
splits, widths, vocabularies or query heads T does not divide, key/value heads neither divisible by T nor dividing
it. Memory per rank: 1/T of each split weight, its gradient, master and states; activations inside the attention
and the MLP 1/T. Equal to one process (``tests/parallel/test_autotp.py``). How each slice was cut is recorded
(``plan_slices``), so an export can put the whole model back together and a load read each rank's slice.
The model's own ``Parameter`` objects are kept, each cut to this rank's slice in place, so an optimizer or a list
of parameters made from the model before ``initialize`` holds what trains.
See note: autotp (docs/design-notes.md).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, TypeVar

import torch
from torch import nn

from ..comm import DataParallelGroup
from .mappings import all_reduce, copy_to_tensor, reduce_from_tensor
from .plan_slices import Cut, cut_from, cut_marks
from .registry import ParameterSet
from .tensor_layers import (
    ColumnParallelLinear,
    ReplicatedRowsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    is_tensor_parallel,
    tensor_parallel_marks,
)

ROWWISE = ("rowwise", "rowwise_split_input")  # the input's last dimension split, or whole and split here
LINEAR = ("colwise", *ROWWISE, "colwise_gather_output")
EMBEDDING, EXPERTS, PACKED = "embedding_rowwise", "moe_tp_experts", ("packed_colwise", "packed_rowwise")
REPLICATED_SUMMED = "replicated_with_grad_allreduce"  # Qwen3's per-head norms
LATENT = "mla_kv_a_proj"  # DeepSeek-V2's latent key/value projection: whole, its rotary part's gradient summed
LOCAL = "local_params"  # a module whose own bare parameters the plan cuts (attention sinks, one per head)
MODULE_STYLES = (*LINEAR, EMBEDDING, EXPERTS, REPLICATED_SUMMED, LATENT, LOCAL)
PARAMETER_STYLES = ("colwise", "rowwise", *PACKED)  # an experts or local_params module's own weights


_P = TypeVar("_P", bound=torch.Tensor)


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's plan by its module (or parameter) names from the top, or None."""
    whole_plan = getattr(model, "tp_plan", None)  # Transformers': head and input embeddings included
    if isinstance(whole_plan, dict) and whole_plan:
        return dict(whole_plan)
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inside = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    return {f"{prefix}.{pattern}" if inside else pattern: style for pattern, style in plan.items()}


class Undo:
    """What a split by a plan changed, to put back (``undo()``) when ``initialize`` refuses the run afterwards: the
    attributes it replaced (modules, the attention's key/value grouping), the parameters whose values it cut to
    this rank's slice (the same ``Parameter`` objects: a list of them or an optimizer made before ``initialize``
    still holds what trains), the marks it gave them, and the hooks it added."""

    def __init__(self) -> None:
        self.replaced: list[tuple[Any, str, Any]] = []  # (owner, attribute, what it held)
        self.cut: list[tuple[nn.Parameter, torch.Tensor]] = []  # (parameter, its whole values)
        self.marked: list[tuple[ParameterSet, torch.Tensor]] = []
        self.hooks: list[Any] = []

    def replace(self, owner: Any, attr: str, new: Any) -> None:
        self.replaced.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def cut_to(self, param: nn.Parameter, values: torch.Tensor) -> nn.Parameter:
        """``param`` holding ``values`` (its slice) from now on; its whole values kept until the run starts."""
        self.cut.append((param, param.data))
        param.data = values
        return param

    def mark(self, marks: ParameterSet, param: _P) -> _P:
        self.marked.append((marks, param))
        return marks.add(param)

    def undo(self) -> None:
        for owner, attr, old in reversed(self.replaced):
            setattr(owner, attr, old)
        for param, values in reversed(self.cut):
            param.data = values
        for marks, marked in self.marked:
            marks.discard(marked)
        for hook in self.hooks:
            hook.remove()
        self.replaced, self.cut, self.marked, self.hooks = [], [], [], []


@dataclasses.dataclass
class _Target:
    name: str
    obj: nn.Module | nn.Parameter
    style: str
    owner: nn.Module  # the module holding it (the model for the top)
    attr: str


def _targets(model: nn.Module, plan: dict[str, str], leave: tuple[str, ...] = ()) -> list[_Target]:
    patterns = [(re.compile(re.escape(p).replace(r"\*", r"\d+")), style) for p, style in plan.items()]
    found = []
    named: list[tuple[str, Any]] = [*model.named_modules(), *model.named_parameters(remove_duplicate=False)]
    for name, obj in named:
        if any(name == m or name.startswith(m + ".") for m in leave):
            continue
        for regex, style in patterns:
            if name and regex.fullmatch(name):
                owner_name, _, attr = name.rpartition(".")
                found.append(_Target(name, obj, style, model.get_submodule(owner_name), attr))
    return found


def split_by_plan(model: nn.Module, tp: DataParallelGroup, where: str, leave: tuple[str, ...] = ()) -> Undo:
    """Split ``model`` over ``tp`` by its plan, in place; what it changed (nothing: a model without a plan, or one
    already split by zeroplus's own tensor-parallel layers). ``where``: the key and rank for an error (a
    ``ValueError``; the model is then as it was). ``leave``: modules (by name) the plan's entries on which, and on
    what they hold, are not applied (the experts modules AutoEP splits instead)."""
    done = Undo()
    plan = tp_plan(model)
    if plan is None or any(is_tensor_parallel(p) for p in model.parameters()):
        return done
    targets = _targets(model, plan, leave)
    heads = _Heads.of(model, tp.size)
    _check(model, targets, heads, tp.size, where)
    sliced: set[int] = set()  # the parameters cut so far (a head tied to the embeddings shares their slice)
    try:
        for t in targets:
            _split(t, tp, heads, sliced, done)
    except BaseException:
        done.undo()
        raise
    return done


def check_plan(model: nn.Module, size: int, where: str) -> None:
    """Whether ``model``'s plan splits over ``size`` tensor ranks, without splitting it: the ``ValueError``
    ``split_by_plan`` would raise (a model without a plan included), or none."""
    plan = tp_plan(model)
    if plan is None:
        raise ValueError(f"{where}: {type(model).__name__} has no tensor-parallel plan (a Hugging Face model's "
                         f"base_model_tp_plan) to split it by")
    _check(model, _targets(model, plan), _Heads.of(model, size), size, where)


def exchanged_per_token(model: nn.Module, leave: tuple[str, ...] = ()) -> tuple[int, int]:
    """(elements all-reduced, elements all-gathered) over the tensor group per token of a training micro-batch, forward
    and backward, once ``model`` is split by its plan: a ``colwise`` module's input gradient (its input is copied to
    every rank), a ``rowwise`` module's and the embedding's partial outputs, the head's input gradient and its logits
    gathered, an experts module's input gradient and output. (Qwen3's per-head norms sum their gradients once a step:
    weights, not tokens, left out.) Whole widths: a planner's nominal count, before any split. ``leave``: as
    ``split_by_plan`` takes it (the experts modules AutoEP splits instead)."""
    plan = tp_plan(model)
    if plan is None:
        return 0, 0
    reduced = gathered = 0
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
    for t in _targets(model, plan, leave):
        obj = t.obj
        if t.style == EXPERTS:
            reduced += 2 * hidden
        elif isinstance(obj, nn.Linear) and t.style in LINEAR:
            reduced += obj.out_features if t.style in ROWWISE else obj.in_features
            gathered += obj.out_features if t.style == "colwise_gather_output" else 0
            gathered += obj.in_features if t.style == "rowwise_split_input" else 0  # its input's gradient
        elif isinstance(obj, nn.Linear) and t.style == LATENT:
            reduced += int(getattr(getattr(model, "config", None), "qk_rope_head_dim", 0) or 0)
        elif isinstance(obj, nn.Embedding) and t.style == EMBEDDING:
            reduced += obj.embedding_dim
    return reduced, gathered


@dataclasses.dataclass(frozen=True)
class _Heads:
    """The attention's head counts from the model's config (None where it does not say)."""
    query: int | None
    key_value: int | None
    head_dim: int | None
    tensor: int
    rope: int | None = None  # a latent attention's rotary width (``qk_rope_head_dim``)

    @classmethod
    def of(cls, model: nn.Module, tensor: int) -> _Heads:
        config: Any = getattr(model, "config", None)
        query = getattr(config, "num_attention_heads", None)
        key_value = getattr(config, "num_key_value_heads", None) or query
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // query if query and getattr(config, "hidden_size", None) else None)
        return cls(query, key_value, head_dim, tensor, getattr(config, "qk_rope_head_dim", None))

    @property
    def replicated(self) -> bool:
        """Fewer key/value heads than tensor ranks, T a multiple of them: each rank computes the one it reads."""
        kv = self.key_value
        return kv is not None and kv % self.tensor != 0 and self.tensor % kv == 0

    def is_key_value(self, linear: nn.Linear) -> bool:
        return self.replicated and self.head_dim is not None and self.key_value is not None and \
            linear.out_features == self.key_value * self.head_dim


def _split(t: _Target, tp: DataParallelGroup, heads: _Heads, sliced: set[int], done: Undo) -> None:
    if t.style == REPLICATED_SUMMED:  # whole on every rank, each seeing its own heads: gradients summed over T
        params = [t.obj] if isinstance(t.obj, nn.Parameter) else list(t.obj.parameters(recurse=False))
        done.hooks += [p.register_hook(functools.partial(_summed_over, tp)) for p in params]
    elif t.style == LOCAL:  # (its own parameters the plan names are targets of their own)
        pass
    elif t.style == LATENT:
        assert heads.rope is not None and isinstance(t.obj, nn.Linear)  # (checked)
        done.hooks.append(t.obj.register_forward_hook(functools.partial(_rotary_summed, tp, heads.rope)))
    elif t.style == EXPERTS:
        experts = t.obj
        assert isinstance(experts, nn.Module)  # (a module style)
        done.hooks.append(experts.register_forward_pre_hook(functools.partial(_experts_in, tp), with_kwargs=True))
        done.hooks.append(experts.register_forward_hook(functools.partial(_experts_out, tp)))
    elif isinstance(t.obj, nn.Parameter):
        _cut(t.obj, _parameter_cut(t), tp, sliced, done)
    elif isinstance(t.obj, nn.Embedding):
        with torch.device("meta"):
            table = VocabParallelEmbedding(t.obj.num_embeddings, t.obj.embedding_dim, padding_idx=t.obj.padding_idx,
                                           tp=tp)
        table.weight = _cut(t.obj.weight, Cut(0), tp, sliced, done)
        done.replace(t.owner, t.attr, table)
    else:
        assert isinstance(t.obj, nn.Linear)  # (checked)
        done.replace(t.owner, t.attr, _split_linear(t, tp, heads, sliced, done))


def _cut(param: torch.Tensor, cut: Cut, tp: DataParallelGroup, sliced: set[int], done: Undo) -> nn.Parameter:
    """``param`` cut to this rank's slice in place (once: a weight tied to another already cut is as it is), marked
    as split over the tensor group and recorded as cut."""
    assert isinstance(param, nn.Parameter)
    if id(param) not in sliced:
        sliced.add(id(param))
        done.cut_to(param, cut_from(param.detach(), cut, tp))
        done.mark(tensor_parallel_marks(), param)
        done.mark(cut_marks(cut, "tensor"), param)
    return param


def _split_linear(t: _Target, tp: DataParallelGroup, heads: _Heads, sliced: set[int], done: Undo) -> nn.Module:
    linear = t.obj
    assert isinstance(linear, nn.Linear)
    if t.style == "colwise" and heads.is_key_value(linear):  # the key/value head this rank's query heads read
        assert heads.query is not None and heads.key_value is not None and heads.head_dim is not None
        head = tp.rank * heads.key_value // tp.size
        if t.owner.num_key_value_groups == heads.query // heads.key_value:  # (the model's: once per attention)
            done.replace(t.owner, "num_key_value_groups", heads.query // tp.size)
        return ReplicatedRowsLinear(linear, head * heads.head_dim, (head + 1) * heads.head_dim, tp)
    bias = linear.bias is not None
    with torch.device("meta"):  # (no memory, no random draws: the model's own parameters go in below)
        if t.style in ROWWISE:
            split: nn.Module = RowParallelLinear(linear.in_features, linear.out_features, bias=bias, tp=tp,
                                                 split_input=t.style == "rowwise_split_input")
        else:
            split = ColumnParallelLinear(linear.in_features, linear.out_features, bias=bias, tp=tp,
                                         gather_output=t.style == "colwise_gather_output")
    assert isinstance(split, (RowParallelLinear, ColumnParallelLinear))
    cut = Cut(1 if t.style in ROWWISE else 0)
    split.weight = _cut(linear.weight, cut, tp, sliced, done)
    if linear.bias is not None:  # a row-parallel bias is whole: added once, after the sum
        split.bias = _cut(linear.bias, cut, tp, sliced, done) if cut.dim == 0 else linear.bias
    return split


def _parameter_cut(t: _Target) -> Cut:
    """An experts module's weight of two or more dimensions, or a ``local_params`` module's own parameter (a 1-D one
    along its one dimension): ``colwise``/``packed_colwise`` along its second-to-last,
    ``rowwise``/``packed_rowwise`` along its last (Transformers' own placements: the plan names the dimension, not
    which way the module multiplies); a packed cut in two parts where the gate and up projection are concatenated,
    one where interleaved (``is_concatenated`` false: the pairs stay together)."""
    assert isinstance(t.obj, nn.Parameter)
    ndim = t.obj.dim()
    packed = 2 if t.style in PACKED and getattr(t.owner, "is_concatenated", True) else 1
    return Cut(ndim - 1 if t.style in ("rowwise", "packed_rowwise") else max(ndim - 2, 0), packed)


def _summed_over(tp: DataParallelGroup, grad: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's gradient from this rank's heads, summed over the tensor group (a collective every
    tensor rank's backward reaches in the same order)."""
    return all_reduce(grad.clone(memory_format=torch.contiguous_format), tp)


def _rotary_summed(tp: DataParallelGroup, rope: int, module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
    """A latent projection's output, whole on every rank, with its last ``rope`` outputs' gradient (from this rank's
    heads) summed over the tensor group."""
    latent, rotary = output.split([output.shape[-1] - rope, rope], dim=-1)
    return torch.cat([latent, copy_to_tensor(rotary, tp)], dim=-1)


def _experts_in(tp: DataParallelGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The experts' floating inputs (the hidden states, the routing weights): whole on every rank, their gradients
    (from this rank's part of every expert) summed over the tensor group."""
    def whole_in(v: Any) -> Any:
        return copy_to_tensor(v, tp) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return tuple(whole_in(a) for a in args), {k: whole_in(v) for k, v in kwargs.items()}


def _experts_out(tp: DataParallelGroup, module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
    """Every expert's output from this rank's part of it, summed over the tensor group."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"AutoTP: {type(module).__name__} ('moe_tp_experts') returned {type(output).__name__}, "
                        f"not the one tensor of partial outputs it sums over the tensor group")
    return reduce_from_tensor(output, tp)


def _check(model: nn.Module, targets: list[_Target], heads: _Heads, size: int, where: str) -> None:
    kind = type(model).__name__
    other = sorted({f"{t.name}: {t.style}" for t in targets if t.style not in (
        PARAMETER_STYLES if isinstance(t.obj, nn.Parameter) else MODULE_STYLES)})
    if other:
        raise ValueError(f"{where}: {kind}'s tensor-parallel plan names styles zeroplus does not split yet "
                         f"({', '.join(other[:4])}{' ...' if len(other) > 4 else ''}); splits modules "
                         f"{', '.join(MODULE_STYLES)} and an experts module's weights {', '.join(PARAMETER_STYLES)}")
    owners = {id(t.obj): t.style for t in targets if t.style in (EXPERTS, LOCAL)}
    wrong = [f"{t.name} ({type(t.obj).__name__}, {t.style})" for t in targets if not _kind_fits(t, owners, heads.rope)]
    if wrong:
        raise ValueError(f"{where}: {kind}'s plan names what its style does not split: {wrong[:4]} (linear styles "
                         f"split an nn.Linear, '{EMBEDDING}' an nn.Embedding without max_norm, sparse or frequency "
                         f"scaling, '{LATENT}' an nn.Linear wider than the config's qk_rope_head_dim ({heads.rope}), "
                         f"weight styles the 2-D or wider weights of a '{EXPERTS}' module or the parameters of a "
                         f"'{LOCAL}' one)")
    if not any(t.style in (*LINEAR, EMBEDDING) for t in targets):
        raise ValueError(f"{where}: {kind}'s tensor-parallel plan matches none of its modules")
    _check_ties(model, targets, f"{where}: {kind}")
    grouping = [t.name for t in targets if isinstance(t.obj, nn.Linear) and t.style == "colwise"
                and heads.is_key_value(t.obj) and not isinstance(getattr(t.owner, "num_key_value_groups", None), int)]
    if grouping:
        raise ValueError(f"{where}: {kind} has {heads.key_value} key/value heads, fewer than {size} tensor ranks, "
                         f"and the attention holding {grouping[0]} has no num_key_value_groups to regroup them by")
    uneven = [f"num_attention_heads = {heads.query}"] if heads.query is not None and heads.query % size else []
    if heads.key_value is not None and heads.key_value % size and size % heads.key_value:
        uneven.append(f"num_key_value_heads = {heads.key_value} (neither a multiple nor a divisor of {size})")
    uneven += [f"{t.name} {what} = {width}" for t in targets for what, width in _widths(t, heads) if width % size]
    if uneven:
        raise ValueError(f"{where}: {kind} does not split over {size} tensor ranks: {', '.join(uneven[:4])} "
                         f"{'is' if len(uneven) == 1 else 'are'} not divisible by {size}")


def _check_ties(model: nn.Module, targets: list[_Target], where: str) -> None:
    """A weight held by more than one module (a head tied to the input embeddings) is split only where every holder
    is split the same way, by vocabulary rows; otherwise the tie would silently break."""
    split = {id(t.obj): t for t in targets if t.style in (*LINEAR, EMBEDDING) and isinstance(t.obj, nn.Module)}
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(name)
    for t in split.values():
        weight = getattr(t.obj, "weight", None)
        for name in holders.get(id(weight), []):
            if model.get_submodule(name) is t.obj:
                continue
            other = split.get(id(model.get_submodule(name)))
            if other is None or {other.style, t.style} - {"colwise", "colwise_gather_output", EMBEDDING}:
                raise ValueError(f"{where}: {t.name}.weight is tied to {name}'s, which the plan "
                                 f"{'does not split' if other is None else f'splits {other.style!r}'}; "
                                 f"a tied weight splits only by vocabulary rows on every holder")


def _kind_fits(t: _Target, owners: dict[int, str], rope: int | None) -> bool:
    if isinstance(t.obj, nn.Parameter):
        owner = owners.get(id(t.owner))
        return owner == LOCAL and t.obj.dim() >= 1 or owner == EXPERTS and t.obj.dim() >= 2
    if t.style in LINEAR:
        return isinstance(t.obj, nn.Linear)
    if t.style == LATENT:
        return isinstance(t.obj, nn.Linear) and rope is not None and 0 < rope < t.obj.out_features
    if t.style == EMBEDDING:
        e = t.obj
        return isinstance(e, nn.Embedding) and e.max_norm is None and not e.sparse and not e.scale_grad_by_freq
    return True


def _widths(t: _Target, heads: _Heads) -> list[tuple[str, int]]:
    """What ``t``'s style cuts into T parts (a key/value projection T outnumbers is kept whole)."""
    obj = t.obj
    if isinstance(obj, nn.Parameter):
        cut = _parameter_cut(t)
        return [(f"dim {cut.dim}" + (f" / {cut.packed} packed" if cut.packed > 1 else ""),
                 obj.shape[cut.dim] // cut.packed)]
    if isinstance(obj, nn.Embedding):
        return [("num_embeddings", obj.num_embeddings)]
    if isinstance(obj, nn.Linear) and t.style in ROWWISE:
        return [("in_features", obj.in_features)]
    if isinstance(obj, nn.Linear) and t.style in ("colwise", "colwise_gather_output") and not heads.is_key_value(obj):
        return [("out_features", obj.out_features)]
    return []
