"""Turn a DeepSpeed ZeRO-1/2 checkpoint into a zeroplus checkpoint that ``load_checkpoint`` resumes.

DeepSpeed (0.19) stages 1-2 save, per rank, ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``
holding that rank's fp32 partition of each flat param group (``single_partition_of_fp32_groups``),
the torch optimizer's states for that partition (``base_optimizer_state``) and, per parameter,
where its fragment lies in the partition (``param_slice_mappings``); ``mp_rank_00_model_states.pt``
holds shapes, tied names (``shared_params``), frozen parameters, buffers, counters and the schedule.
Rank R's partition starts at ``R * P`` in the group's flat buffer (P = rank 0's partition length),
so a parameter's offset is where its first fragment lies; each DeepSpeed group becomes one
zeroplus group and each rank's partition one saved range. The zeroplus loader matches parameters
by name, so the result loads at any world size and stage. Stage 3 checkpoints are refused (not
built yet). Memory: one rank's files at a time.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Any

import torch

from . import checkpoint_io as io

_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


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
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as err:
        raise ValueError(f"reading {path} needs DeepSpeed installed (pip install 'zeroplus[deepspeed]'): {err}") \
            from None


def convert_deepspeed(ds_dir: str, out_dir: str, tag: str | None = None) -> str:
    """Write ``out_dir/TAG`` (and ``out_dir/latest``); return its path."""
    tag = _ds_tag(ds_dir, tag)
    src = os.path.join(ds_dir, tag)
    model_file = os.path.join(src, "mp_rank_00_model_states.pt")
    optim_files = sorted((int(m.group(1)), os.path.join(src, f)) for f in os.listdir(src)
                         if (m := _OPTIM_FILE.match(f)))
    if glob.glob(os.path.join(src, "zero_pp_rank_*_model_states.pt")):  # stage 3 writes one per rank
        raise NotImplementedError(f"{src} is a DeepSpeed ZeRO-3 checkpoint; importing ZeRO-3 is not built yet")
    if not optim_files:
        raise FileNotFoundError(f"{src} has no DeepSpeed ZeRO optimizer files (*zero_pp_rank_*_optim_states.pt)")
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"DeepSpeed model states {model_file} are missing")
    model = _load(model_file)
    ranks = [r for r, _ in optim_files]
    if ranks != list(range(len(ranks))):
        raise FileNotFoundError(f"{src}: optimizer files for ranks {ranks}; expected ranks 0..{len(ranks) - 1}")
    world = len(ranks)
    states = [_load(path)["optimizer_state_dict"] for _, path in optim_files]
    if "single_partition_of_fp32_groups" not in states[0]:
        raise NotImplementedError(f"{optim_files[0][1]}: unknown DeepSpeed optimizer layout "
                                  f"(keys {sorted(states[0])})")
    ds_config = model.get("ds_config", {}) or {}
    groups_meta, per_rank = [], [dict() for _ in range(world)]
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
            opt = s["base_optimizer_state"]["state"].get(gi, {})
            # the last rank's partition omits the group's padding; its states keep it: cut to size
            sliced = {k: v[:sizes[r]] for k, v in opt.items() if isinstance(v, torch.Tensor) and v.numel() > 1
                      and v.numel() >= sizes[r]}
            whole = {k: v for k, v in opt.items() if k not in sliced}
            per_rank[r][name] = {"lo": starts[r], "hi": starts[r] + sizes[r],
                                 "master": s["single_partition_of_fp32_groups"][gi].float(),
                                 "sliced": sliced, "whole": whole}
    # Frozen parameters and buffers: everything in the module's state that is not trained or tied
    # (DeepSpeed stages 1-2 leave ``frozen_param_shapes`` empty and keep them in ``module``).
    trained = {n for shapes in model["param_shapes"] for n in shapes} | set(model.get("shared_params") or {})
    extra = {n: t for n, t in model["module"].items() if n not in trained}
    gas = int(ds_config.get("gradient_accumulation_steps", 1) or 1)
    counters = {"global_steps": model["global_steps"], "micro_steps": model["global_steps"] * gas,
                "global_samples": model.get("global_samples", 0), "skipped_steps": model.get("skipped_steps", 0)}
    scaler = states[0].get("loss_scaler")
    scaler_state = {"scale": float(scaler.cur_scale)} if scaler is not None and states[0].get("dynamic_loss_scale") \
        else {}
    hparams = [{k: v for k, v in pg.items() if k != "params"}
               for pg in states[0]["base_optimizer_state"]["param_groups"]]
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{tag}.tmp-", dir=out_dir)
    digests = []
    for r in range(world):
        digests.append(io.save_rank_state(tmp, r, {
            "rank": r, "groups": per_rank[r], "module_extra": extra if r == 0 else {}, "client_state": {},
            "counters": counters, "loss_scaler": scaler_state, "lr_scheduler": model.get("lr_scheduler"),
            "optimizer_hparams": hparams, "rng": None}))
    meta = {"format": io.FORMAT_VERSION, "tag": tag, "world_size": world,
            "stage": int(getattr(states[0].get("zero_stage"), "value", states[0].get("zero_stage") or 0)),
            "aliases": dict(model.get("shared_params") or {}), "compute_dtype": None,
            "global_steps": model["global_steps"], "groups": groups_meta,
            "files": {str(r): d for r, d in enumerate(digests)}, "config": ds_config,
            "imported_from": f"DeepSpeed {model.get('ds_version', '?')} {src}"}
    final = os.path.join(out_dir, tag)
    io.commit(tmp, final, meta)
    io.write_latest(out_dir, tag)
    return final
