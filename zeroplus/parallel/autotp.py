"""AutoTP: a Hugging Face causal LM split over the tensor group by its own tensor-parallel plan.

``"tensor_parallel": {"autotp_size": T}`` (DeepSpeed's key; or ``zeroplus.parallel.tensor``) on a model that has
no tensor-parallel layer of zeroplus's and whose config carries Transformers' ``base_model_tp_plan``: each
``nn.Linear`` the plan names becomes a ``ColumnParallelLinear`` (``colwise``: this rank's rows of the weight and
bias, so its heads of ``q_proj``/``k_proj``/``v_proj`` and its slice of ``gate_proj``/``up_proj``) or a
``RowParallelLinear`` (``rowwise``: its columns of ``o_proj``/``down_proj``, the partial outputs all-reduced), with
the weights the model holds (``load_dense``). Nothing else changes: Transformers' attention reshapes by
``head_dim`` and repeats key/value heads by their ratio, so this rank's query and key/value heads attend as the
whole model's would. The embeddings, the head and the norms stay whole on every rank (the gradient norm counts
them once: ``tensor_layers.is_tensor_parallel``). ZeRO shards over the data group beside it.

``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm``/``k_norm``): whole on every rank, each rank's
gradient (from its own heads) summed over the tensor group by a hook on the parameter.
Refused before anything changes, naming the key, the rank and what does not split: a plan entry of another style
(``packed_colwise``, ``moe_tp_experts``: Mixtral's experts),
a named module that is not an ``nn.Linear``, and query or key/value heads (or widths) that T does not divide.
Memory per rank: 1/T of each split weight, its gradient, master and states; activations inside the attention and
the MLP 1/T. Equal to one process (``tests/parallel/test_autotp.py``). The slices it cuts are recorded
(``split_dim``), so an export can put the whole model back together (``whole``: ``save_pretrained``).
See note: autotp (docs/design-notes.md).
"""
from __future__ import annotations

import functools
import re
from typing import Any

import torch
from torch import nn

from ..comm import DataParallelGroup
from .mappings import all_reduce
from .registry import ParameterSet
from .tensor_layers import ColumnParallelLinear, RowParallelLinear, is_tensor_parallel

STYLES: dict[str, type[ColumnParallelLinear] | type[RowParallelLinear]] = {"colwise": ColumnParallelLinear,
                                                                        "rowwise": RowParallelLinear}
REPLICATED_SUMMED = "replicated_with_grad_allreduce"  # Qwen3's per-head norms
_ROWS, _COLUMNS = ParameterSet(), ParameterSet()  # the slices split_by_plan made: by rows, by columns


def split_dim(param: object) -> int | None:
    """The dimension ``split_by_plan`` cut ``param`` along over the tensor group (0: rows, 1: columns), None where it
    did not cut it (whole on every tensor rank, or split by another layer of zeroplus's, such as
    ``TensorParallelGPT``'s interleaved q, k and v)."""
    return 0 if param in _ROWS else 1 if param in _COLUMNS else None


def whole(slices: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    """The whole tensor from every tensor rank's slice of shape ``shape``, in rank order, laid end to end in
    ``slices`` (what an all-gather of the flattened slices gives), cut along ``dim``."""
    size = slices.numel() // shape.numel()
    pieces = slices.view(size, *shape)
    return pieces.reshape(size * shape[0], *shape[1:]) if dim == 0 else \
        pieces.permute(1, 0, *range(2, pieces.dim())).reshape(shape[0], size * shape[1], *shape[2:])


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's plan by its module names (Transformers writes it relative to the base model), or None."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inside = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    return {f"{prefix}.{pattern}" if inside else pattern: style for pattern, style in plan.items()}


class Undo:
    """What ``split_by_plan`` changed, to put back (``undo()``) when ``initialize`` refuses the run afterwards: the
    modules it replaced and the gradient hooks it added."""

    def __init__(self) -> None:
        self.modules: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, the module it held)
        self.hooks: list[Any] = []

    def undo(self) -> None:
        for parent, attr, module in reversed(self.modules):
            setattr(parent, attr, module)
        for hook in self.hooks:
            hook.remove()
        self.modules, self.hooks = [], []


def split_by_plan(model: nn.Module, tp: DataParallelGroup, where: str) -> Undo:
    """Split ``model`` over ``tp`` by its plan, in place; what it changed (nothing: a model without a plan, or one
    already split by zeroplus's own tensor-parallel layers). ``where``: the key and rank for an error (a
    ``ValueError``; the model is then as it was)."""
    done = Undo()
    plan = tp_plan(model)
    if plan is None or any(is_tensor_parallel(p) for p in model.parameters()):
        return done
    patterns = [(re.compile(re.escape(p).replace(r"\*", r"\d+")), p, style) for p, style in plan.items()]
    targets: list[tuple[str, nn.Module, str]] = []
    for name, module in model.named_modules():
        for regex, pattern, style in patterns:
            if regex.fullmatch(name):
                targets.append((name, module, style))
    _check(model, targets, tp.size, where)
    for name, module, style in targets:
        if style == REPLICATED_SUMMED:  # whole on every rank, each seeing its own heads: gradients summed over T
            done.hooks += [p.register_hook(functools.partial(_summed_over, tp))
                           for p in module.parameters(recurse=False)]
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = module
        assert isinstance(linear, nn.Linear)  # (checked)
        split = STYLES[style](linear.in_features, linear.out_features, bias=linear.bias is not None, tp=tp)
        split.to(device=linear.weight.device, dtype=linear.weight.dtype)
        split.load_dense(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        split.weight.requires_grad_(linear.weight.requires_grad)
        (_ROWS if style == "colwise" else _COLUMNS).add(split.weight)
        if style == "colwise" and split.bias is not None:
            _ROWS.add(split.bias)
        done.modules.append((parent, attr, module))
        setattr(parent, attr, split)
    return done


def _summed_over(tp: DataParallelGroup, grad: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's gradient from this rank's heads, summed over the tensor group (a collective every
    tensor rank's backward reaches in the same order)."""
    return all_reduce(grad.clone(memory_format=torch.contiguous_format), tp)


def _check(model: nn.Module, targets: list[tuple[str, nn.Module, str]], size: int, where: str) -> None:
    kind = type(model).__name__
    other = sorted({f"{name}: {style}" for name, _, style in targets if style not in (*STYLES, REPLICATED_SUMMED)})
    if other:
        raise ValueError(f"{where}: {kind}'s tensor-parallel plan names styles zeroplus does not split yet "
                         f"({', '.join(other[:4])}{' ...' if len(other) > 4 else ''}); splits 'colwise' and "
                         f"'rowwise', and sums '{REPLICATED_SUMMED}' gradients, only")
    targets = [t for t in targets if t[2] in STYLES]  # (the summed ones stay as they are)
    wrong = [f"{name} ({type(m).__name__})" for name, m, _ in targets if not isinstance(m, nn.Linear)]
    if wrong:
        raise ValueError(f"{where}: {kind}'s plan names modules that are not nn.Linear: {wrong[:4]}")
    if not targets:
        raise ValueError(f"{where}: {kind}'s tensor-parallel plan matches none of its modules")
    config: Any = getattr(model, "config", None)
    heads = {"num_attention_heads": getattr(config, "num_attention_heads", None),
             "num_key_value_heads": getattr(config, "num_key_value_heads", None)}
    uneven = [f"{k} = {v}" for k, v in heads.items() if v is not None and v % size]
    for name, m, style in targets:
        assert isinstance(m, nn.Linear)  # (checked above)
        width = m.out_features if style == "colwise" else m.in_features
        if width % size:
            uneven.append(f"{name} {'out' if style == 'colwise' else 'in'}_features = {width}")
    if uneven:
        raise ValueError(f"{where}: {kind} does not split over {size} tensor ranks: {', '.join(uneven[:4])} "
                         f"{'is' if len(uneven) == 1 else 'are'} not divisible by {size} (key/value heads are not "
                         f"replicated yet)")
