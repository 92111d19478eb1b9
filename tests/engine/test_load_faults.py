"""Loading a checkpoint is safe and all-or-nothing.

Safe: a rank file holding a pickled ``__reduce__`` (one that would create a file when unpickled) is
refused by ``load_checkpoint``, ``zeroplus convert`` and ``zeroplus convert --from-deepspeed``, with its
digest rewritten in ``metadata.json`` as an attacker would: the error names the file, the marker file
never appears.
All-or-nothing: on 2 ranks at ZeRO stages 0-3, an engine trains 2 steps, saves, trains a third; then
loads copies of that checkpoint broken one way each (rank 0's file corrupt, rank 1's file corrupt,
rank 1's file missing, rank 1's file a crafted pickle, a buffer of another shape in rank 0's file).
Every rank raises, naming the broken file, and every rank's masters, optimizer states, module
parameters and buffers, counters, loss scale and schedule are bitwise what they were before the call;
after that the good checkpoint loads and training goes on. A failure localises to the read phase
(``engine/checkpoints/load.py``) letting a rank write before the others agreed.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train


class Planted:
    """Unpickling this calls ``open(marker, "w")``: code run by a checkpoint file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "error", "memory_estimate": False}}


def _rewrite_digest(path: str) -> None:
    """Record ``path``'s new SHA-256 in its metadata.json, as whoever changed the file would."""
    meta_path = os.path.join(os.path.dirname(path), "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(path, "rb") as f:
        meta["files"][str(int(os.path.basename(path)[4:9]))] = hashlib.sha256(f.read()).hexdigest()
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def plant(path: str, marker: str) -> None:
    """Replace a rank file by a crafted pickle and rewrite its digest in metadata.json."""
    torch.save({"groups": Planted(marker)}, path)
    _rewrite_digest(path)


def _corrupt(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(200)
        f.write(b"corrupt!")


def _wrong_buffer(path: str) -> None:
    """Rank 0's file with a buffer of another shape (the frozen layer's weight), digest rewritten."""
    state = torch.load(path, weights_only=True)
    state["module_extra"]["frozen.weight"] = torch.zeros(3, 3)
    torch.save(state, path)
    _rewrite_digest(path)


FAULTS = {  # name: (file broken, how)
    "corrupt0": ("rank00000.pt", _corrupt),
    "corrupt1": ("rank00001.pt", _corrupt),
    "missing1": ("rank00001.pt", os.remove),
    "planted1": ("rank00001.pt", None),
    "buffer0": ("rank00000.pt", _wrong_buffer),
}


def _snapshot(engine) -> dict:
    out = {f"{g.name}/master": g.master_store.read(0, g.owned_numel).clone() for g in engine.partition.groups}
    for g in engine.partition.groups:
        for key, value in engine.optimizer_state(g).items():
            out[f"{g.name}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    out.update({f"module/{k}": v.clone() for k, v in engine.module.state_dict().items()})
    out.update(counters=(engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps),
               scale=engine.loss_scale, lr=engine.get_lr(), sched=dict(engine.lr_scheduler.state_dict()))
    return out


def _differences(a: dict, b: dict) -> list[str]:
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def _faulty_loads(root: str, marker: str) -> dict:
    rank, world = rank_and_world()
    batches = make_batches(8 * world, 2)
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), _config(stage))
        path = os.path.join(root, f"s{stage}")
        engine_train(engine, batches, 2, rank, world, 1)
        engine.save_checkpoint(path, tag="good")
        engine_train(engine, batches, 1, rank, world, 1, start=2)
        before = _snapshot(engine)
        for fault, (file, how) in FAULTS.items():
            if rank == 0:
                shutil.copytree(os.path.join(path, "good"), os.path.join(path, fault))
                target = os.path.join(path, fault, file)
                plant(target, marker) if how is None else how(target)
            dist.barrier()
            with pytest.raises(Exception) as caught:
                engine.load_checkpoint(path, tag=fault)
            out[(stage, fault)] = {"error": f"{type(caught.value).__name__}: {caught.value}",
                                   "changed": _differences(before, _snapshot(engine))}
        engine.load_checkpoint(path, tag="good")
        out[(stage, "after")] = {"steps": engine.global_steps,
                                 "loss": engine_train(engine, batches, 1, rank, world, 1, start=2)[0]}
    return out


def test_failed_loads_change_nothing_on_any_rank(tmp_path):
    marker = str(tmp_path / "code-ran")
    results = run_distributed(_faulty_loads, 2, str(tmp_path), marker)
    assert not os.path.exists(marker), "a checkpoint file ran code"
    for stage in (0, 1, 2, 3):
        for fault, (file, _) in FAULTS.items():
            for rank, result in enumerate(results):
                seen = result[(stage, fault)]
                assert seen["changed"] == [], f"stage {stage}, {fault}: rank {rank} changed {seen['changed']}"
                assert os.path.join(f"s{stage}", fault, file) in seen["error"], \
                    f"stage {stage}, {fault}: rank {rank} raised {seen['error']}"
        assert "refused to load" in results[1][(stage, "planted1")]["error"]
        assert "another shape" in results[0][(stage, "buffer0")]["error"]
        assert [r[(stage, "after")]["steps"] for r in results] == [2, 2]


def test_crafted_pickles_are_refused_by_convert(tmp_path):
    """``zeroplus convert`` of a zeroplus checkpoint and of a DeepSpeed-shaped one: refused, nothing ran."""
    marker = str(tmp_path / "code-ran")
    engine = zeroplus.initialize(ParityNet(), _config(1))
    engine_train(engine, make_batches(2, 2), 1, 0, 1, 1)
    ckpt = str(tmp_path / "ckpt")
    engine.save_checkpoint(ckpt, tag="t")
    plant(os.path.join(ckpt, "t", "rank00000.pt"), marker)
    ds_tag = tmp_path / "ds" / "global_step1"
    ds_tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    torch.save({"module": Planted(marker)}, ds_tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": Planted(marker)}, ds_tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    for args, broken in ((["convert", ckpt, str(tmp_path / "out.pt")], "rank00000.pt"),
                         (["convert", "--from-deepspeed", str(tmp_path / "ds"), str(tmp_path / "zp")], "_states.pt")):
        done = subprocess.run([sys.executable, "-m", "zeroplus.cli", *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "refused to load" in done.stderr and broken in done.stderr, done.stderr
    assert not os.path.exists(marker), "a checkpoint file ran code"
