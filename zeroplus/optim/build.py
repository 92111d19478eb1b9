"""Build the optimizer from the config's ``optimizer`` block, or adopt a client optimizer.

Names follow DeepSpeed, case-insensitively: ``Adam`` is AdamW (decoupled weight decay) unless
``adam_w_mode: false``, as DeepSpeed's Adam is; ``AdamW``; ``SGD``; ``Lamb`` (zeroplus's own,
``lamb.py``); any other ``torch.optim`` class by name. DeepSpeed-only parameters with no meaning
here (``torch_adam``, ``fused``-kernel switches of DeepSpeed, ...) are dropped with one warning;
an unknown parameter is an error naming it. Where torch has a fused kernel for the device
(Adam, AdamW, SGD, Adagrad on CPU and CUDA), it is used unless ``zeroplus.fused_optimizer`` is
false: DESIGN.md measured it adding no shard-sized temporary, against one or two for the
foreach and loop paths.
See note: host optimizer; see note: element-wise optimizers (docs/design-notes.md).
"""
from __future__ import annotations

import difflib
import inspect
import logging
from typing import Any

import torch

from zeroplus.logs import log_rank0

from .lamb import Lamb
from .muon import ShardedMuon, muon_kwargs
from .stored_states import StoredStates, stored_states_class

logger = logging.getLogger("zeroplus.optim")

# DeepSpeed optimizer parameters that mean nothing to the torch or zeroplus implementation.
_DS_ONLY = {"torch_adam", "adam_w_mode", "fp32_optimizer_states", "cuda_aware", "comm_backend_name", "freeze_step",
            "set_grad_none", "bias_correction", "max_grad_norm", "amsgrad_mode"}
_FUSED_CAPABLE = {"Adam", "AdamW", "SGD", "Adagrad"}


# torch.optim classes whose update of an element reads only that element's gradient and states and the param
# group's scalars: stepped on a flat shard (a run of elements cut across parameters) they give, element by element,
# what they give stepping each parameter whole. Not so: Adafactor (second moments factored over a matrix's rows and
# columns), Muon (Newton-Schulz on whole matrices), LBFGS (one history over all parameters), SparseAdam (sparse
# gradients); nor bitsandbytes' 8-bit optimizers (states quantized in blocks that a shard would cut elsewhere).
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "ASGD", "Rprop",
                         "Adadelta"})


def check_elementwise(cls: type[torch.optim.Optimizer], declared: bool, what: str) -> None:
    """Refuse an optimizer zeroplus does not know to update element by element: its ``step`` comes from one of
    torch's ``ELEMENTWISE`` classes or zeroplus's Lamb (whose per-parameter norms are taken over the shards, lamb.py),
    unless the config declares it (``zeroplus.elementwise_optimizer``). ``what``: how the user gave it."""
    # (torch wraps a class's step in a profiling hook once an instance exists: unwrapped, it is the function defined)
    step = inspect.unwrap(cls.step)
    known = {inspect.unwrap(getattr(torch.optim, name).step) for name in ELEMENTWISE} | {
        inspect.unwrap(Lamb.step), inspect.unwrap(StoredStates.step), inspect.unwrap(ShardedMuon.step)}
    if step in known or declared:
        return
    raise ValueError(
        f"{what} {cls.__module__}.{cls.__qualname__} is not known to update each element from that element alone "
        f"(its step() is {step.__module__}.{step.__qualname__}), and zeroplus steps flat shards cut across "
        f"parameters at every stage: an optimizer whose math depends on a parameter's shape (Adafactor's factored "
        f"moments, Muon's whole matrices, LBFGS, bitsandbytes' block-wise 8-bit states) would train a different "
        f"model. Use one of torch.optim's {', '.join(sorted(ELEMENTWISE))}, or zeroplus's Lamb (for Muon: an "
        f"'optimizer' block of type 'Muon' in the config, which makes each matrix whole for its step); or, if its "
        f"update is element-wise, say so with config key 'zeroplus.elementwise_optimizer': true")


def resolve_optimizer_class(type_name: str, params: dict[str, Any]) -> type[torch.optim.Optimizer]:
    name = type_name.lower()
    if name == "adam":
        return torch.optim.AdamW if params.get("adam_w_mode", True) else torch.optim.Adam
    if name == "lamb":
        return Lamb
    if name == "muon":  # (before torch.optim.Muon: zeroplus's steps flat shards, torch's whole matrices)
        return ShardedMuon
    for attr in dir(torch.optim):
        cls = getattr(torch.optim, attr)
        if attr.lower() == name and isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            return cls
    raise ValueError(f"optimizer.type {type_name!r} is not supported: use Adam, AdamW, SGD, Lamb or a torch.optim "
                     f"class name")


def optimizer_kwargs(cls: type[torch.optim.Optimizer], type_name: str, params: dict[str, Any],
                     fused: bool) -> dict[str, Any]:
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    kwargs: dict[str, Any] = {}
    dropped = []
    for key, value in params.items():
        if key in accepted and not (cls is not Lamb and key == "bias_correction"):
            kwargs[key] = tuple(value) if key == "betas" else value
        elif key in _DS_ONLY:
            dropped.append(key)
        else:
            close = difflib.get_close_matches(key, sorted(accepted), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"config key 'optimizer.params.{key}' (value {value!r}) is not a parameter of "
                             f"{cls.__name__}{hint}")
    if "bias_correction" in dropped and params.get("bias_correction") is False:
        raise ValueError(f"config key 'optimizer.params.bias_correction' is false, which torch's {cls.__name__} "
                         f"cannot do")
    if dropped:
        log_rank0("optimizer.params %s are DeepSpeed-only and have no effect with %s", sorted(dropped),
                  cls.__name__, level=logging.WARNING)
    if fused and cls.__name__ in _FUSED_CAPABLE and "fused" in accepted and "foreach" not in kwargs:
        kwargs.setdefault("fused", True)
    return kwargs


def build_optimizer(type_name: str, params: dict[str, Any], param_groups: list[dict[str, Any]],
                    fused: bool, states: dict[str, Any] | None = None) -> torch.optim.Optimizer:
    """The optimizer the config names over ``param_groups``; ``states``: its moments stored in other dtypes
    (``stored_states.requested``; Adam and AdamW only, else a ValueError naming the config key)."""
    cls = resolve_optimizer_class(type_name, params)
    kwargs = muon_kwargs(params, fused) if cls is ShardedMuon else optimizer_kwargs(cls, type_name, params, fused)
    if states is not None:
        try:
            cls = stored_states_class(cls)
        except ValueError as err:
            raise ValueError(f"config key 'zeroplus.optimizer_states' (or 'bf16.bf16_optimizer_states'): {err}, and "
                             f"optimizer.type is {type_name!r}") from None
        kwargs.update(states)
    try:
        return cls(param_groups, **kwargs)
    except (RuntimeError, ValueError, TypeError) as err:
        if kwargs.pop("fused", None):
            logger.info("fused %s unavailable here (%s); using the default kernel", cls.__name__, err)
            return cls(param_groups, **kwargs)
        raise ValueError(f"optimizer {type_name} with params {params}: {err}") from None


def would_fuse(type_name: str, params: dict[str, Any], fused: bool) -> bool:
    """Whether ``build_optimizer`` asks torch for its fused kernel (CPU and CUDA have one)."""
    cls = resolve_optimizer_class(type_name, params)
    return cls is not ShardedMuon and bool(optimizer_kwargs(cls, type_name, params, fused).get("fused"))


def describe_client_optimizer(optimizer: torch.optim.Optimizer) -> tuple[str, dict[str, Any]]:
    """The config ``optimizer`` block (type, params) that builds an optimizer like ``optimizer`` (a client's:
    the Trainer's, Accelerate's, the user's), so the memory budget can simulate its states: its class by
    name (a ``torch.optim`` class or zeroplus's Lamb; zeroplus's DeepSpeed stand-ins, ``DeepSpeedCPUAdam``
    and the like, as their torch base class) and the first param group's hyper-parameters that the class
    takes. Raises ``ValueError`` naming the class when the budget cannot build one like it."""
    given = type(optimizer)
    known = [c for c in given.__mro__ if c is Lamb or (c.__module__.startswith("torch.optim")
                                                        and getattr(torch.optim, c.__name__, None) is c)]
    cls = known[0] if known else torch.optim.Optimizer
    # a subclass may keep any state of its own: only zeroplus's stand-ins (deepspeed_api/ops.py) are known
    # to keep their torch base class's
    if cls is torch.optim.Optimizer or (cls is not given and not given.__module__.startswith("zeroplus.")):
        raise ValueError(f"the client optimizer {given.__module__}.{given.__qualname__} is not a torch.optim class "
                         f"or zeroplus's Lamb, so its states cannot be sized; give the config an 'optimizer' block "
                         f"instead, or set zeroplus.memory_estimate false")
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    group = optimizer.param_groups[0] if optimizer.param_groups else optimizer.defaults
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k in accepted}
    if cls is torch.optim.Adam:
        params["adam_w_mode"] = False  # (the config's "Adam" is AdamW otherwise: resolve_optimizer_class)
    params.pop("foreach", None)  # the kernel choice: fused as the client's, else the loop
    if not params.pop("fused", None):
        params["fused"] = False
    return cls.__name__, params


def adopt_client_optimizer(optimizer: torch.optim.Optimizer, groups_params: list[list[torch.nn.Parameter]]
                           ) -> torch.optim.Optimizer:
    """Point a client optimizer's param groups at the master shards, keeping the object (and any
    scheduler bound to it) and its per-group hyper-parameters."""
    if len(groups_params) != len(optimizer.param_groups):
        raise AssertionError("one list of master parameters per client param group expected")
    if optimizer.state:
        logger.warning("the client optimizer already has state; it is discarded (states live on the shards)")
        optimizer.state.clear()
    for group, params in zip(optimizer.param_groups, groups_params):
        group["params"] = params
    return optimizer
