"""``zeroplus estimate``: each rank's memory for a model, a config and a world size, before launching.

    zeroplus estimate --model 111m --config configs/zero3_bf16.json --world-size 1024 --seq-len 2048
    zeroplus estimate --model mypkg.models:build --config ds.json --world-size 64 --seq-len 512 --json

``--model`` is a built-in GPT size (``tiny``, ``small``, ``medium``, ``111m``) or
``module:factory``, a function of no arguments returning the model; it is called on the meta
device, so nothing is allocated. With tensor, pipeline or expert sizes in the config's
``zeroplus.parallel`` it is called as rank ``--rank`` would call it, with that rank's groups
(``virtual_parallel.py``): the built-in GPT is then its tensor-parallel form, its pipeline stage,
and takes its experts (``--experts N`` gives it MoE blocks); a factory's tensor-parallel layers,
``PipelineModule`` and MoE layers take their slice the same way. With ``--seq-len`` (token ids
of ``--micro-batch-size`` x ``--seq-len``; the config's micro-batch by default) it prints the
full budget of
``estimate.py``: per phase (init, forward, backward, step) and category, the peak and its phase.
Without it, only the model states (``model_states.py``): activations depend on the input.
With ``--budget 16GB`` (or a config with ``zeroplus.memory_budget`` and ``"auto"`` keys) it prints
the planner's choice (``planner.py``), the same one ``initialize`` would make, and with ``--budget``
how many ranks each ZeRO stage needs to fit it. ``--construction init`` (or ``meta``) predicts the
init phase of a model built under ``zeroplus.Init`` (or on the meta device) instead of built whole.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from typing import Any, Callable

from ..config import ConfigError, auto_keys, parse_bytes, parse_config
from ..meta_values import SimulationError
from ..models import GPT, gpt_config
from ..models.split import split_gpt
from .estimate import estimate
from .model_states import model_state_bytes
from .planner import Settings, apply_settings, plan
from .simulate import CONSTRUCTIONS
from .virtual_parallel import topology_of


def _builder(spec: str, config: str, experts: int = 0) -> Callable[[], Any]:
    if ":" not in spec:
        moe = dict(moe_experts=experts, moe_k=min(2, experts)) if experts else {}
        gpt_config(spec)  # raises ValueError naming the known sizes
        par = parse_config(config)[0].zeroplus.parallel
        return lambda: split_gpt(GPT(gpt_config(spec, **moe)), sequence_parallel=par.sequence_parallel,
                                 overlap_chunks=par.overlap_chunks)
    if experts:
        raise ValueError(f"--experts is for the built-in GPT; {spec!r} builds its own model")
    module_name, factory = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(module_name), factory)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {spec!r}: cannot load {factory!r} from {module_name!r}: {err}") from None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zeroplus estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--config", required=True, help="DeepSpeed-style JSON config")
    p.add_argument("--world-size", type=int, required=True, help="all ranks (data x tensor x pipeline)")
    p.add_argument("--experts", type=int, default=0,
                   help="built-in GPT: each block's MLP a top-2 mixture of this many experts")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--seq-len", type=int, help="sequence length of one micro-batch (the full budget)")
    p.add_argument("--micro-batch-size", type=int, help="default: the config's train_micro_batch_size_per_gpu")
    p.add_argument("--budget", help="bytes per rank ('16GB'): choose the cheapest config that fits (needs --seq-len)")
    p.add_argument("--chart", help="also write the budget as a PNG here (needs zeroplus[plotting])")
    p.add_argument("--construction", choices=CONSTRUCTIONS, default="whole",
                   help="how the model reaches initialize: built whole (default), under zeroplus.Init, or on the "
                        "meta device (the init phase differs)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.chart is not None and args.seq_len is None:
        p.error("--chart needs --seq-len")
    if args.budget is not None and args.seq_len is None:
        p.error("--budget needs --seq-len: activations are part of the budget")
    try:
        if args.seq_len is not None:
            return _full_budget(args)
        build = _builder(args.model, args.config, args.experts)
        predicted = model_state_bytes(build, args.config, args.world_size, args.rank)
    except (ValueError, ConfigError, SimulationError) as err:
        print(f"zeroplus estimate: {err}", file=sys.stderr)
        return 2
    predicted["total_on_device"] = sum(v for k, v in predicted.items() if not k.endswith("_offloaded"))
    if args.json:
        print(json.dumps({"world_size": args.world_size, "rank": args.rank, "model_state_bytes": predicted}))
        return 0
    print(f"model states of rank {args.rank} of {args.world_size} ({args.model}, {args.config}):")
    for key, value in predicted.items():
        print(f"  {key:<22}{value:>16,} B {value / 2**30:>10.3f} GiB")
    print("give --seq-len for activations, buffers and the predicted peak")
    return 0


def _tiles(cfg: Any, world: int) -> bool:
    """Whether ``world`` ranks hold the config's parallel layout (``Topology`` refuses it otherwise)."""
    try:
        topology_of(cfg, world)
    except ValueError:
        return False
    return True


def ranks_needed(build: Callable[[], Any], config: str, budget: int, max_world: int, seq_len: int,
                 micro_batch_size: int | None, construction: str) -> dict[int, int | None]:
    """For ZeRO stages 1-3 (nothing offloaded, no shared masters, no recompute: the config's other keys as
    given), the fewest ranks, a power of two up to ``max_world``, whose predicted peak is within ``budget``
    (None: none is). A binary search: the peak falls as ranks are added. Only world sizes the config's
    tensor, pipeline, expert and context sizes can tile are tried."""
    sizes = [2**k for k in range(max(0, max_world).bit_length()) if 2**k <= max_world]
    sizes = [w for w in sizes if _tiles(parse_config(config)[0], w)]
    out: dict[int, int | None] = {}
    parsed = parse_config(config)[0]
    for stage in (1, 2) if parsed.zeroplus.parallel.pipeline > 1 else (1, 2, 3):  # (stage 3 beside pipelines: refused)
        cfg = apply_settings(parse_config(config)[0], Settings(stage, None, False, False))

        def fits(world: int, cfg: Any = cfg) -> bool:
            return estimate(build, cfg, world_size=world, micro_batch_size=micro_batch_size, seq_len=seq_len,
                            construction=construction).peak_bytes <= budget
        if not sizes or not fits(sizes[-1]):
            out[stage] = None
            continue
        lo, hi = 0, len(sizes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(sizes[mid]) else (mid + 1, hi)
        out[stage] = sizes[lo]
    return out


def _full_budget(args: argparse.Namespace) -> int:
    chosen, build = None, _builder(args.model, args.config, args.experts)
    if args.budget is not None or auto_keys(parse_config(args.config)[0]):
        chosen = plan(build, args.config, world_size=args.world_size, budget=args.budget,
                      rank=args.rank, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                      log=None if args.json else print)
        budget = chosen.budget
    else:
        budget = estimate(build, args.config, world_size=args.world_size, rank=args.rank,
                          micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                          construction=args.construction)
    needed = None if args.budget is None else ranks_needed(build, args.config, parse_bytes(args.budget),
                                                           args.world_size, args.seq_len, args.micro_batch_size,
                                                           args.construction)
    if args.chart is not None:
        budget.save_chart(args.chart)
    if args.json:
        head = {} if chosen is None else {"plan": dataclasses.asdict(chosen.settings), "reason": chosen.reason,
                                          "budget_bytes": chosen.budget_bytes}
        if needed is not None:
            head["ranks_needed"] = needed
        print(json.dumps({**head, **budget.to_dict()}))
        return 0
    if chosen is not None:
        print(f"planner: {chosen.reason}")
    if needed is not None:
        print(f"ranks needed within {args.budget} per rank (plain ZeRO, powers of two up to {args.world_size}, "
              f"model {args.construction}): " + "; ".join(
                  f"stage {stage}: {n if n is not None else f'more than {args.world_size}'}"
                  for stage, n in needed.items()))
    print(budget.table())
    if args.chart is not None:
        print(f"chart: {args.chart}")
    return 0
