"""Checkpoints: bit-exact resume, elastic loading, crash safety, and bad input.

Resume: 10 steps straight (saving after 5) versus a fresh set of processes that loads and runs the last 5:
identical losses and bitwise-identical fp32 masters and optimizer states, for stages 0-3 in
fp32, bf16 and fp16 (loss scaler and WarmupLR schedule included), and bf16 with shared-storage
master weights at stages 1 and 3, on 2 ranks.
Elastic: saved at 2 ranks and stage 3, loaded at 1 rank (stages 3 and 2) and at 4 ranks: the
same masters and optimizer states, bitwise, and training continues. The stage-3 save copies
no state: its files stream from the shards (under 1/8 of the file's bytes created as tensors).
Crash: a rank killed in the middle of a save leaves the previous checkpoint as ``latest``,
loadable; no partial tag directory appears.
"""
from __future__ import annotations

import os

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.new_storage import NewStorageBytes
from tests.reference import engine_train

MICRO = 2


def _config(stage: int, dtype: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "bf16": {"enabled": dtype.startswith("bf16")},
            "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 12, "loss_scale_window": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False,
                         "shared_master_weights": dtype == "bf16-shared",
                         "master_step_chunk": 64}}


def _steps(engine, first: int, last: int, world: int = 2) -> list[float]:
    rank, _ = rank_and_world()
    return engine_train(engine, make_batches(10 * world, MICRO), last - first, rank, world, 1, start=first)


def _full_state(engine) -> dict:
    """Masters and optimizer states of every group, whole (a collective)."""
    out = {}
    for g in engine.partition.groups:
        out[g.name + "/master"] = g.gather_master()
        for key, value in sorted(engine.optimizer.state.get(g.master_param, {}).items()):
            if isinstance(value, torch.Tensor) and value.numel() == g.owned_numel and value.numel() > 1:
                out[f"{g.name}/{key}"] = g.gather_owned(value)
            else:
                out[f"{g.name}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _resume_cases(cases: list, ckpt_root: str, mode: str) -> list[dict]:
    out = []
    for stage, dtype in cases:
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), _config(stage, dtype))
        path = os.path.join(ckpt_root, f"s{stage}-{dtype}")
        if mode == "straight":  # saving half-way changes nothing in the run that saves
            losses = _steps(engine, 0, 5)
            engine.save_checkpoint(path, client_state={"epoch": 3})
            losses += _steps(engine, 5, 10)
        else:
            torch.manual_seed(123)  # a fresh start would differ; the checkpoint must win
            _, client = engine.load_checkpoint(path)
            assert client == {"epoch": 3} and engine.global_steps == 5
            losses = _steps(engine, 5, 10)
        out.append({"losses": losses, "state": _full_state(engine), "scale": engine.loss_scale,
                    "lr": engine.get_lr(), "skipped": engine.skipped_steps})
    return out


def test_resume_is_bit_exact(tmp_path):
    cases = [(s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16", "fp16")]
    cases += [(1, "bf16-shared"), (3, "bf16-shared")]
    _assert_resume_is_bit_exact(cases, tmp_path)


@pytest.mark.fast
def test_resume_at_stage_3_in_bf16_is_bit_exact(tmp_path):
    """The fast tier's checkpoint round trip: one case of the test above."""
    _assert_resume_is_bit_exact([(3, "bf16")], tmp_path)


def _assert_resume_is_bit_exact(cases: list, tmp_path) -> None:
    straight = run_distributed(_resume_cases, 2, cases, str(tmp_path), "straight")[0]
    second = run_distributed(_resume_cases, 2, cases, str(tmp_path), "second")[0]
    for case, a, b2 in zip(cases, straight, second):
        assert a["losses"][5:] == b2["losses"], f"{case}: losses"
        assert (a["scale"], a["lr"], a["skipped"]) == (b2["scale"], b2["lr"], b2["skipped"]), f"{case}: scalars"
        assert set(a["state"]) == set(b2["state"]), case
        for key, value in a["state"].items():
            other = b2["state"][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"{case}: {key} differs after resume"


def _save_at_two(path: str) -> dict:
    """Train 3 steps at stage 3, save; return the full state, the tensor bytes the save created and the bytes
    it wrote for this rank."""
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(3, "fp32"))
    _steps(engine, 0, 3)
    with NewStorageBytes() as born:
        engine.save_checkpoint(path)
    rank, _ = rank_and_world()
    with open(os.path.join(path, "latest")) as f:
        written = os.path.getsize(os.path.join(path, f.read(), f"rank{rank:05d}.pt"))
    return {"state": _full_state(engine), "tensor_bytes": born.peak,
            "written": written}


def _load_elsewhere(path: str, stage: int) -> dict:
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(stage, "fp32"))
    engine.load_checkpoint(path)
    state = _full_state(engine)
    _, world = rank_and_world()
    losses = _steps(engine, 3, 4, world=world)
    return {"state": state, "loss": losses[0], "steps": engine.global_steps}


def test_elastic_load_at_other_world_sizes_and_stages(tmp_path):
    path = str(tmp_path / "ckpt")
    saves = run_distributed(_save_at_two, 2, path)
    for rank, save in enumerate(saves):  # the files stream from the shards themselves: no copy of the state
        assert save["tensor_bytes"] < save["written"] // 8, f"rank {rank}: {save['tensor_bytes']} bytes copied " \
                                                            f"to save {save['written']}"
    saved = saves[0]["state"]
    loaded = [_load_elsewhere(path, 3), _load_elsewhere(path, 2)]  # 1 rank, in this process
    loaded.append(run_distributed(_load_elsewhere, 4, path, 3)[0])
    for i, result in enumerate(loaded):
        for key, value in saved.items():
            other = result["state"][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, f"load {i}: {key}"
        assert result["steps"] == 4 and result["loss"] == result["loss"]


def _crash_during_save(path: str, crash_rank: int, point: str) -> None:
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(2, "fp32"))
    _steps(engine, 0, 2)
    engine.save_checkpoint(path, tag="good")
    _steps(engine, 2, 3)
    if rank == crash_rank:
        os.environ["ZEROPLUS_CHECKPOINT_FAULT"] = point
    engine.save_checkpoint(path, tag="doomed", keep_latest_k=1)  # retention only after a commit: "good" stays


def _load_latest(path: str) -> int:
    engine = zeroplus.initialize(ParityNet(), _config(2, "fp32"))
    engine.load_checkpoint(path)
    return engine.global_steps


@pytest.mark.parametrize("crash_rank,point", [(1, "after_rank_file_1"), (0, "before_rename"),
                                              (0, "before_latest")])
def test_crash_mid_save_keeps_last_good_checkpoint(tmp_path, crash_rank, point):
    path = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError, match="died with exit code 17|failed"):
        run_distributed(_crash_during_save, 2, path, crash_rank, point, timeout=120)
    with open(os.path.join(path, "latest")) as f:
        assert f.read() == "good"
    if point != "before_latest":
        assert not os.path.exists(os.path.join(path, "doomed"))
    assert run_distributed(_load_latest, 2, path) == [2, 2]


def test_keep_latest_k_removes_older_checkpoints_once_a_newer_one_is_committed(tmp_path):
    """``zeroplus.keep_latest_k`` (config) and ``keep_latest_k=`` (argument): after each save the k newest complete
    checkpoints stay, the one ``latest`` names always; a DeepSpeed tag and other folders are not touched; the
    last-kept one still loads. (The crash test above: a save that dies before its commit removes nothing.)"""
    path = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(path, "global_step0"))  # a DeepSpeed tag: its files, no zeroplus metadata
    open(os.path.join(path, "global_step0", "mp_rank_00_model_states.pt"), "wb").close()
    os.makedirs(os.path.join(path, "notes"))
    engine = zeroplus.initialize(ParityNet(), dict(_config(1, "fp32"), zeroplus={"log_level": "warning",
                                                                                 "keep_latest_k": 2}))
    kept = []
    for tag in ("a", "b", "c"):
        _steps(engine, 0, 1, world=1)
        engine.save_checkpoint(path, tag=tag)
        kept.append(sorted(os.listdir(path)))
    assert kept == [["a", "global_step0", "latest", "notes"], ["a", "b", "global_step0", "latest", "notes"],
                    ["b", "c", "global_step0", "latest", "notes"]]
    engine.save_checkpoint(path, tag="d", save_latest=False, keep_latest_k=1)  # latest still names c: kept
    assert sorted(os.listdir(path)) == ["c", "d", "global_step0", "latest", "notes"]
    with pytest.raises(ValueError, match=r"keep_latest_k=0.*positive number"):
        engine.save_checkpoint(path, tag="e", keep_latest_k=0)
    assert not os.path.exists(os.path.join(path, "e"))
    again = zeroplus.initialize(ParityNet(), _config(1, "fp32"))
    again.load_checkpoint(path)
    assert again.global_steps == engine.global_steps


def _tags_differ(path: str) -> dict:
    rank, _ = rank_and_world()
    out = {}
    for mode in ("Fail", "warn"):
        engine = zeroplus.initialize(ParityNet(), dict(_config(2, "fp32"), checkpoint={"tag_validation": mode}))
        try:
            out[mode] = engine.save_checkpoint(os.path.join(path, mode), tag=f"t{rank}")
        except ValueError as err:
            out[mode] = str(err)
    return out


def test_checkpoint_tag_validation_and_refused_checkpoint_keys(tmp_path):
    """DeepSpeed's ``checkpoint`` block: ranks saving under different tags fail on every rank before anything is
    written (Fail) or save under the first rank's (Warn, the default); ``load_universal`` and
    ``use_node_local_storage`` true are refused, naming the key and what to do instead."""
    path = str(tmp_path)
    for rank, out in enumerate(run_distributed(_tags_differ, 2, path)):
        assert "rank 0 't0', rank 1 't1'" in out["Fail"] and "nothing was saved" in out["Fail"], out
        assert out["warn"] == os.path.join(path, "warn", "t0"), out
    assert not os.path.exists(os.path.join(path, "Fail")) or os.listdir(os.path.join(path, "Fail")) == []
    assert sorted(os.listdir(os.path.join(path, "warn"))) == ["latest", "t0"]
    for key, says in (("load_universal", "load_checkpoint"), ("use_node_local_storage", "shared filesystem")):
        with pytest.raises(zeroplus.ConfigError, match=rf"checkpoint\.{key}'.*{says}"):
            zeroplus.initialize(ParityNet(), dict(_config(1, "fp32"), checkpoint={key: True}))
    with pytest.raises(zeroplus.ConfigError, match=r"checkpoint\.tag_validation'.*Warn, Ignore, Fail"):
        zeroplus.initialize(ParityNet(), dict(_config(1, "fp32"), checkpoint={"tag_validation": "sometimes"}))


def test_bad_checkpoints_are_clear_errors(tmp_path):
    path = str(tmp_path / "ckpt")
    engine = zeroplus.initialize(ParityNet(), _config(1, "fp32"))
    _steps(engine, 0, 1, world=1)
    engine.save_checkpoint(path, tag="t1")
    with pytest.raises(FileNotFoundError, match=r"tag 'nope' not found .*\['t1'\]"):
        engine.load_checkpoint(path, tag="nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_checkpoint(str(tmp_path / "missing"))
    other = zeroplus.initialize(ParityNet(n_blocks=2), _config(1, "fp32"))
    with pytest.raises(ValueError, match=r"unexpected parameters \['blocks.2.down.bias'"):
        other.load_checkpoint(path)
    shard = os.path.join(path, "t1", "rank00000.pt")
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"corrupt!")
    with pytest.raises(ValueError, match=r"rank00000.pt \(rank 0's shard\) is corrupt"):
        engine.load_checkpoint(path)
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=r"rank00000.pt \(rank 0's shard\) is missing"):
        engine.load_checkpoint(path)


def _train_save_and_16bit(path: str, out_dir: str) -> dict:
    torch.manual_seed(0)
    model = ParityNet()
    model.blocks[0].register_buffer("inv_freq", torch.arange(4.0), persistent=False)  # as a rotary embedding's:
    engine = zeroplus.initialize(model, _config(3, "bf16"))  # not in the model's state_dict(), nor in an export
    _steps(engine, 0, 3)
    engine.save_checkpoint(path)
    engine.save_16bit_model(out_dir)
    return engine.consolidated_fp32_state()


def test_export_fp32_state_dict_loads_into_the_plain_model(tmp_path):
    import subprocess
    import sys

    from safetensors.torch import load_file
    path, out_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    masters = run_distributed(_train_save_and_16bit, 2, path, out_dir)[0]
    sd = zeroplus.load_fp32_state_dict(path)
    plain = ParityNet()
    plain.load_state_dict(sd, strict=True)  # tied head and frozen layer included
    for name, value in masters.items():
        assert torch.equal(sd[name], value), name
    assert torch.equal(sd["head.weight"], sd["embed.weight"])
    for out in ("model.safetensors", "model.pt"):
        target = str(tmp_path / out)
        done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", path, target], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        loaded = load_file(target) if out.endswith(".safetensors") else torch.load(target)
        assert set(loaded) == set(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd), out
    bad = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", str(tmp_path / "none"), target],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
    sixteen = torch.load(os.path.join(out_dir, "pytorch_model.bin"))
    bf16_model = ParityNet().to(torch.bfloat16)
    bf16_model.load_state_dict(sixteen, strict=True)
    assert all(v.dtype == torch.bfloat16 for v in sixteen.values() if v.is_floating_point())
    assert torch.equal(sixteen["blocks.0.up.weight"], masters["blocks.0.up.weight"].to(torch.bfloat16))


def test_load_with_other_param_groups_matches_by_name(tmp_path):
    """Saved with one param group, loaded with two (decay / no decay): parameters are matched by name."""
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(1, "fp32"))
    _steps(engine, 0, 2, world=1)
    engine.save_checkpoint(path)
    saved = engine.consolidated_fp32_state()
    model = ParityNet()
    groups = [{"params": [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.requires_grad and p.dim() < 2], "weight_decay": 0.0}]
    other = zeroplus.initialize(model, _config(3, "fp32"), model_parameters=groups)
    other.load_checkpoint(path, load_optimizer_states=False)
    loaded = other.consolidated_fp32_state()
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_checkpoint_without_frozen_parameters_loads_only_non_strict(tmp_path):
    """``exclude_frozen_parameters=True`` (the Trainer's for a PEFT model) leaves the frozen layer out of the
    files; loading it strictly is an error naming the frozen parameters and the way forward, nothing
    loaded; ``strict=False`` loads the trained parameters and keeps this model's frozen ones."""
    path = str(tmp_path / "ckpt")
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(1, "fp32"))
    _steps(engine, 0, 2, world=1)
    engine.save_checkpoint(path, tag="adapter", exclude_frozen_parameters=True)
    saved = torch.load(os.path.join(path, "adapter", "rank00000.pt"), weights_only=True)["module_extra"]
    assert not [n for n in saved if n.startswith("frozen.")], sorted(saved)
    torch.manual_seed(1)
    other = zeroplus.initialize(ParityNet(), _config(1, "fp32"))
    own_frozen = other.module.frozen.weight.detach().clone()
    before = _full_state(other)
    with pytest.raises(ValueError, match=r"lacks 2 frozen parameters of this model \(frozen.weight, frozen.bias; "
                                         r"rank 0\).*exclude_frozen_parameters=True.*strict=False"):
        other.load_checkpoint(path, tag="adapter")
    assert all(torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]
               for k, v in _full_state(other).items()), "a refused load changes nothing"
    other.load_checkpoint(path, tag="adapter", strict=False)
    assert torch.equal(other.module.frozen.weight, own_frozen), "the model's own frozen parameters are kept"
    ours, theirs = _full_state(engine), _full_state(other)
    assert all(torch.equal(v, theirs[k]) if isinstance(v, torch.Tensor) else v == theirs[k] for k, v in ours.items())
    assert other.global_steps == engine.global_steps == 2
