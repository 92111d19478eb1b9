"""``zeroplus estimate``: model-state bytes per rank for a model, a config and a world size.

    zeroplus estimate --model 111m --config configs/zero3_bf16.json --world-size 1024
    zeroplus estimate --model mypkg.models:build --config ds.json --world-size 64 --json

``--model`` is a built-in GPT size (``tiny``, ``small``, ``medium``, ``111m``) or
``module:factory``, a function of no arguments returning the model; it is called on the meta
device, so nothing is allocated. Prints ``model_states.py``'s prediction: low-precision
parameters, stage-3 persistent parameters, fp32 masters and optimizer states. Activations,
gradient buckets and offload windows are not predicted yet (the memory-budget issue).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable

from .model_states import model_state_bytes


def _builder(spec: str) -> Callable[[], Any]:
    from ..models import GPT, gpt_config
    if ":" not in spec:
        gpt_config(spec)  # raises ValueError naming the known sizes
        return lambda: GPT(gpt_config(spec))
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
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        predicted = model_state_bytes(_builder(args.model), args.config, args.world_size, args.rank)
    except ValueError as err:
        print(f"zeroplus estimate: {err}", file=sys.stderr)
        return 2
    predicted["total_on_device"] = sum(v for k, v in predicted.items() if not k.endswith("_offloaded"))
    if args.json:
        print(json.dumps({"world_size": args.world_size, "rank": args.rank, "model_state_bytes": predicted}))
        return 0
    print(f"model states of rank {args.rank} of {args.world_size} ({args.model}, {args.config}):")
    for key, value in predicted.items():
        print(f"  {key:<22}{value:>16,} B {value / 2**30:>10.3f} GiB")
    print("activations, gradient buckets and offload windows are not predicted yet")
    return 0
