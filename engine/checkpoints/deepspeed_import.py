"""Turn a DeepSpeed ZeRO-1/2/3 checkpoint into a zeroplus checkpoint that ``load_checkpoint`` resumes.

Stages 1-2 (DeepSpeed 0.19) save, per rank, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``
holding that rank's fp32 partition of each flat param group (``single_partition_of_fp32_groups``),
the torch optimizer's states for that partition (``base_optimizer_state``) and, per parameter,
where its fragment lies in the partition (``param_slice_mappings``); ``mp_rank_00_model_states.pt``
holds shapes, tied names (``shared_params``), frozen parameters, buffers, counters and the schedule.
Rank R's partition starts at ``R * P`` in the group's flat buffer (P = rank 0's partition length),
so a parameter's offset is where its first fragment lies; each DeepSpeed group becomes one
zeroplus group and each rank's partition one saved range.

Stage 3 saves one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (shapes, tied names,
and each rank's ``frozen_param_fragments``) and optimizer files whose ``fp32_flat_groups`` (one
per sub-group) concatenate, in ``param_shapes`` order, each parameter's own partition:
``ceil(numel / N)`` elements per rank, rank R holding elements ``[R * p, (R + 1) * p)``. The
optimizer states of sub-group k have the same layout as ``fp32_flat_groups[k]``. So each DeepSpeed
parameter becomes one zeroplus group of one parameter with N saved ranges.

The script's ``client_state`` (the keys DeepSpeed merged into its model-states files) becomes each rank's
client state: at stage 3 from the rank's own file, at stages 1-2 from rank 0's, the only one.
The zeroplus loader matches parameters by name, so the result loads at any world size and stage.
Memory: every rank's optimizer file is read (fp32 masters and states of the whole model, 12 bytes
per parameter with Adam) before the output is written, one rank file at a time.
"""
from __future__ import annotations

import glob
import math
import os
import re
import tempfile
from typing import Any

import torch

from . import files as io
from .safe_load import load_weights_only

_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_STAGE3_MODEL_FILE = "zero_pp_rank_{}_mp_rank_00_model_states.pt"


def _is_deepspeed(path: str) -> bool:
    """``path`` is a DeepSpeed checkpoint tag: it holds DeepSpeed's model or optimizer files and no zeroplus
    metadata."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, io.METADATA)):
        return False
    return any(_OPTIM_FILE.match(f) or f == "mp_rank_00_model_states.pt" for f in os.listdir(path))


def deepspeed_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag of the DeepSpeed checkpoint in ``load_dir`` that a load of ``tag`` means (None: the one ``latest``
    names, or without ``latest`` the only DeepSpeed tag there), or None when that is not a DeepSpeed checkpoint
    (one zeroplus wrote, or nothing: the zeroplus loader says what is missing)."""
    if not os.path.isdir(load_dir):
        return None
    if tag is None:
        latest = os.path.join(load_dir, io.LATEST)
        if os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
        else:
            found = [t for t in sorted(os.listdir(load_dir)) if _is_deepspeed(os.path.join(load_dir, t))]
            if len(found) != 1:
                return None
            tag = found[0]
    return tag if _is_deepspeed(os.path.join(load_dir, tag)) else None


def _ds_tag(ds_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(ds_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{latest} does not exist: give --tag for the DeepSpeed checkpoint in {ds_dir}")
        with open(latest) as f:
            tag = f.read().strip()
    if not os.path.isdir(os.path.join(ds_dir, tag)):
        raise FileNotFoundError(f"DeepSpeed checkpoint {os.path.join(ds_dir, tag)} does not exist")
    return tag


def _load(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed checkpoint file {path} is missing")
    return load_weights_only(path, what=f"DeepSpeed checkpoint file {path}", deepspeed=True)


# What DeepSpeed 0.19 writes into a model-states file itself (``_common_checkpoint_state`` and its MoE and universal
# checkpoint metadata); every other top-level key is the ``client_state`` a script gave ``save_checkpoint`` (DeepSpeed
# merges it into the same dict) and is returned by ``load_checkpoint`` on resume.
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info", "num_experts", "ds_autoep_layers", "autoep_layers", "folding"})


def client_state_of(model: dict[str, Any]) -> dict[str, Any]:
    """The script's own keys of one DeepSpeed model-states file (what DeepSpeed's ``load_checkpoint`` returns, less
    its own bookkeeping)."""
    return {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS}


def _split_states(opt: dict[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer-state tensors laid out like the partition (``sliced``) versus scalars (``whole``).
    The last rank's partition may omit padding that its states keep: those are cut to ``numel``."""
    sliced = {k: v[:numel] for k, v in opt.items() if isinstance(v, torch.Tensor) and v.numel() > 1
              and v.numel() >= numel}
    return sliced, {k: v for k, v in opt.items() if k not in sliced}


def _stage12_groups(model: dict[str, Any], states: list[dict[str, Any]]) -> tuple[list, list, dict]:
    world = len(states)
    groups_meta: list = []
    per_rank: list[dict[str, Any]] = [{} for _ in range(world)]
    for gi, shapes in enumerate(model["param_shapes"]):
        sizes = [s["single_partition_of_fp32_groups"][gi].numel() for s in states]
        starts = [r * sizes[0] for r in range(world)]
        offsets: dict[str, int] = {}
        for r, s in enumerate(states):
            for name, fragment in s["param_slice_mappings"][gi].items():
                offsets.setdefault(name, starts[r] + fragment.start)
        name = f"ds{gi}"
        groups_meta.append({"name": name, "numel": starts[-1] + sizes[-1],
                            "params": [[n, list(shape), offsets[n]] for n, shape in shapes.items()],
                            "ranges": [[r, starts[r], starts[r] + sizes[r]] for r in range(world)]})
        for r, s in enumerate(states):
            sliced, whole = _split_states(s["base_optimizer_state"]["state"].get(gi, {}), sizes[r])
            per_rank[r][name] = {"lo": starts[r], "hi": starts[r] + sizes[r],
                                 "master": s["single_partition_of_fp32_groups"][gi].float(),
                                 "sliced": sliced, "whole": whole}
    # Frozen parameters and buffers: everything in the module's state that is not trained or tied
    # (DeepSpeed stages 1-2 leave ``frozen_param_shapes`` empty and keep them in ``module``).
    trained = {n for shapes in model["param_shapes"] for n in shapes} | set(model.get("shared_params") or {})
    extra = {n: t for n, t in model["module"].items() if n not in trained}
    return groups_meta, per_rank, extra


def _stage3_rank_flat(state: dict[str, Any], path: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
    """One rank's sub-groups concatenated: masters, per-element optimizer states, and scalars."""
    flats = state["fp32_flat_groups"]
    opt = state["optimizer_state_dict"]["state"]
    tensors: dict[str, list[torch.Tensor]] = {}
    whole: dict[str, Any] = {}
    for k, flat in enumerate(flats):
        sliced, scalars = _split_states(opt.get(k, {}), flat.numel())
        for key, value in sliced.items():
            tensors.setdefault(key, []).append(value)
        for key, value in scalars.items():
            whole.setdefault(key, value)
    incomplete = sorted(k for k, v in tensors.items() if len(v) != len(flats))
    if incomplete:
        raise ValueError(f"{path}: optimizer states {incomplete} are missing for some of the {len(flats)} sub-groups")
    return torch.cat([f.float() for f in flats]), {k: torch.cat(v) for k, v in tensors.items()}, whole


def _stage3_groups(src: str, model: dict[str, Any], states: list[dict[str, Any]],
                   paths: list[str]) -> tuple[list, list, dict, list[dict[str, Any]]]:
    world = len(states)
    shapes = {n: s for group in model["param_shapes"] for n, s in group.items()}
    groups_meta: list = []
    per_rank: list[dict[str, Any]] = [{} for _ in range(world)]
    flats = [_stage3_rank_flat(s, p) for s, p in zip(states, paths)]
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        ranges = [[r, min(r * part, numel), min((r + 1) * part, numel)] for r in range(world)]
        group = f"ds.{name}"
        groups_meta.append({"name": group, "numel": numel, "params": [[name, list(shape), 0]], "ranges": ranges})
        for (r, lo, hi), (master, tensors, whole) in zip(ranges, flats):
            cut = slice(offset, offset + hi - lo)
            per_rank[r][group] = {"lo": lo, "hi": hi, "master": master[cut].clone(),
                                  "sliced": {k: v[cut].clone() for k, v in tensors.items()}, "whole": dict(whole)}
        offset += part
    for (master, _, _), path in zip(flats, paths):
        if master.numel() != offset:
            raise ValueError(f"{path}: fp32_flat_groups hold {master.numel()} elements; the parameter shapes in "
                             f"{src} need {offset} per rank")
    # Frozen parameters are partitioned like trained ones, in every rank's model-states file.
    extra: dict[str, torch.Tensor] = {}
    rank_models = [model] + [_load(os.path.join(src, _STAGE3_MODEL_FILE.format(r))) for r in range(1, world)]
    for name, shape in (model.get("frozen_param_shapes") or {}).items():
        pieces = [m["frozen_param_fragments"][name] for m in rank_models]
        extra[name] = torch.cat(pieces)[:math.prod(shape)].view(shape).clone()
    extra.update({n: model["module"][n] for n in model.get("buffer_names") or [] if n in model["module"]})
    return groups_meta, per_rank, extra, [client_state_of(m) for m in rank_models]


def convert_deepspeed(ds_dir: str, out_dir: str, tag: str | None = None) -> str:
    """Write ``out_dir/TAG`` (and ``out_dir/latest``); return its path."""
    tag = _ds_tag(ds_dir, tag)
    src = os.path.join(ds_dir, tag)
    optim_files = sorted((int(m.group(1)), os.path.join(src, f)) for f in os.listdir(src)
                         if (m := _OPTIM_FILE.match(f)))
    stage3 = bool(glob.glob(os.path.join(src, _STAGE3_MODEL_FILE.format("*"))))  # stage 3 writes one per rank
    if not optim_files:
        raise FileNotFoundError(f"{src} has no DeepSpeed ZeRO optimizer files (*zero_pp_rank_*_optim_states.pt)")
    ranks = [r for r, _ in optim_files]
    if ranks != list(range(len(ranks))):
        raise FileNotFoundError(f"{src}: optimizer files for ranks {ranks}; expected ranks 0..{len(ranks) - 1}")
    world = len(ranks)
    model = _load(os.path.join(src, _STAGE3_MODEL_FILE.format(0) if stage3 else "mp_rank_00_model_states.pt"))
    states = [_load(path)["optimizer_state_dict"] for _, path in optim_files]
    layout_key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
    if layout_key not in states[0]:
        raise NotImplementedError(f"{optim_files[0][1]}: unknown DeepSpeed optimizer layout, expected "
                                  f"{layout_key!r} (keys {sorted(states[0])})")
    if stage3:  # every rank wrote its own model-states file, its client state included
        groups_meta, per_rank, extra, clients = _stage3_groups(src, model, states, [p for _, p in optim_files])
        torch_optimizer = states[0]["optimizer_state_dict"]
    else:  # rank 0's file only: every rank resumes with its client state, as under DeepSpeed
        groups_meta, per_rank, extra = _stage12_groups(model, states)
        clients = [client_state_of(model)] * world
        torch_optimizer = states[0]["base_optimizer_state"]
    ds_config = model.get("ds_config", {}) or {}
    gas = int(ds_config.get("gradient_accumulation_steps", 1) or 1)
    counters = {"global_steps": model["global_steps"], "micro_steps": model["global_steps"] * gas,
                "global_samples": model.get("global_samples", 0), "skipped_steps": model.get("skipped_steps", 0)}
    scaler = states[0].get("loss_scaler")
    scaler_state = {"scale": float(scaler.cur_scale)} if scaler is not None and states[0].get("dynamic_loss_scale") \
        else {}
    hparams = [{k: v for k, v in pg.items() if k != "params"} for pg in torch_optimizer["param_groups"]]
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=out_dir)
    digests = []
    for r in range(world):
        digests.append(io.save_rank_state(tmp, r, {
            "rank": r, "groups": per_rank[r], "module_extra": extra if r == 0 else {}, "client_state": clients[r],
            "counters": counters, "loss_scaler": scaler_state, "lr_scheduler": model.get("lr_scheduler"),
            "optimizer_hparams": hparams, "rng": None}))
    meta = {"format": io.FORMAT_VERSION, "tag": tag, "world_size": world,
            "stage": int(getattr(states[0].get("zero_stage"), "value", states[0].get("zero_stage") or 0)),
            "aliases": dict(model.get("shared_params") or {}), "compute_dtype": None,
            "non_persistent_buffers": [],  # (DeepSpeed saves the state_dict's buffers only)
            "global_steps": model["global_steps"], "groups": groups_meta,
            "files": {str(r): d for r, d in enumerate(digests)}, "config": ds_config,
            "imported_from": f"DeepSpeed {model.get('ds_version', '?')} {src}"}
    final = os.path.join(out_dir, tag)
    io.commit(tmp, final, meta)
    io.write_latest(out_dir, tag)
    return final
