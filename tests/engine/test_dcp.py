"""torch.distributed.checkpoint both ways against a real FSDP2 run.

FSDP2 (``fully_shard`` per block and root, torch's AdamW) trains a tiny GPT-2 two steps on 2 gloo ranks and
saves the way FSDP2 resumes (``get_state_dict``, ``dcp.save``); zeroplus at ZeRO-3 trains the same two
steps on 2 ranks and saves with ``save_checkpoint(format="dcp")``. Each goes on two more steps: the reference
losses. Then at 4 ranks and at 1, zeroplus (ZeRO-3, ZeRO-2) loads FSDP2's checkpoint and FSDP2 loads
zeroplus's: what was loaded equals what was saved bitwise (parameters, both Adam states, the step), and
the next two losses equal the saver's own within fp32 tolerance (the global batch is the same 4 sequences,
split over however many ranks there are, so only reduction order differs). ``flat_boxes`` (the cut of a
flat range into the boxes DCP records) tiles every range of a tensor exactly.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import build
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.engine.checkpoints.dcp_save import flat_boxes

FULL = StateDictOptions(full_state_dict=True)
BATCH = 4  # sequences per step, split over the ranks


def _batch(step: int) -> torch.Tensor:
    rank, world = rank_and_world()
    ids = torch.randint(0, 256, (BATCH, 16), generator=torch.Generator().manual_seed(100 + step))
    per = BATCH // world
    return ids[rank * per:(rank + 1) * per]


def _mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _gpt2() -> torch.nn.Module:
    """The tiny GPT-2 without dropout (FSDP2 and zeroplus draw random numbers differently)."""
    torch.manual_seed(0)
    model = build("gpt2", "tiny")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _fsdp2() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _gpt2()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp2_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean(loss))
    return losses


def _fsdp2_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Copies: at one rank the full state dict's tensors are the live ones."""
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)["state"]
    return {"model": {n: t.clone() for n, t in get_model_state_dict(model, options=FULL).items()},
            "states": {n: {k: torch.as_tensor(v).clone() for k, v in s.items()} for n, s in optim.items()}}


def _engine(stage: int) -> zeroplus.Engine:
    world = rank_and_world()[1]
    cfg = {"train_micro_batch_size_per_gpu": BATCH // world, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    return zeroplus.initialize(_gpt2(), cfg)


def _engine_steps(engine: zeroplus.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = _batch(step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(_mean(loss))
    return losses


def _engine_state(engine: zeroplus.Engine) -> dict:
    states = {}
    for g in engine.partition.groups:
        own = engine.optimizer_state(g)
        whole = {k: g.gather_owned(own[k]) for k in ("exp_avg", "exp_avg_sq")}
        for name, offset, numel, shape in zip(g.names, g.offsets, g.numels, g.shapes):
            states[name] = {k: v[offset:offset + numel].view(shape).clone() for k, v in whole.items()}
            states[name]["step"] = torch.as_tensor(own["step"]).clone()
    return {"model": engine.consolidated_fp32_state(), "states": states}


def _save_both(root: str) -> dict:
    """2 ranks: FSDP2 and zeroplus each train, save at step 2, and go on two steps."""
    model, optimizer = _fsdp2()
    _fsdp2_steps(model, optimizer, range(2))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "fsdp2", "step2"))
    fsdp2_saved = _fsdp2_state(model, optimizer)
    fsdp2_losses = _fsdp2_steps(model, optimizer, range(2, 4))
    engine = _engine(3)
    _engine_steps(engine, range(2))
    engine.save_checkpoint(os.path.join(root, "zeroplus"), format="dcp")
    zeroplus_saved = _engine_state(engine)
    zeroplus_losses = _engine_steps(engine, range(2, 4))
    engine.destroy()
    return {"fsdp2": (fsdp2_saved, fsdp2_losses), "zeroplus": (zeroplus_saved, zeroplus_losses)}


def _resume_both(root: str, stage: int) -> dict:
    """Any world: zeroplus resumes FSDP2's checkpoint, FSDP2 resumes zeroplus's; each goes on two steps."""
    engine = _engine(stage)
    path, _ = engine.load_checkpoint(os.path.join(root, "fsdp2"), "step2")
    assert path == os.path.join(root, "fsdp2", "step2") and engine.global_steps == 2
    zeroplus_loaded = _engine_state(engine)
    zeroplus_losses = _engine_steps(engine, range(2, 4))
    engine.destroy()
    model, optimizer = _fsdp2()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "zeroplus", "global_step2"))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    fsdp2_loaded = _fsdp2_state(model, optimizer)
    fsdp2_losses = _fsdp2_steps(model, optimizer, range(2, 4))
    return {"zeroplus": (zeroplus_loaded, zeroplus_losses), "fsdp2": (fsdp2_loaded, fsdp2_losses)}


def _same_state(loaded: dict, saved: dict, what: str) -> None:
    """Bitwise, over every name zeroplus's side has (FSDP2's also names the tied head)."""
    names = set(saved["model"]) & set(loaded["model"])
    assert names == min(set(saved["model"]), set(loaded["model"]), key=len), what
    for name in names:
        assert torch.equal(loaded["model"][name], saved["model"][name]), f"{what}: {name}"
    for name, states in saved["states"].items():
        for key, value in states.items():
            assert torch.equal(torch.as_tensor(loaded["states"][name][key]).float(),
                               torch.as_tensor(value).float()), f"{what}: {name} {key}"


def test_fsdp2_and_zeroplus_resume_each_others_dcp_checkpoints_at_another_world_size(tmp_path):
    root = str(tmp_path)
    saved = run_distributed(_save_both, 2, root)[0]
    for world, stage in ((4, 3), (1, 2)):
        resumed = run_distributed(_resume_both, world, root, stage)[0]
        # zeroplus resumed FSDP2's checkpoint; FSDP2 resumed zeroplus's
        for resumer, saver in (("zeroplus", "fsdp2"), ("fsdp2", "zeroplus")):
            loaded, losses = resumed[resumer]
            _same_state(loaded, saved[saver][0], f"{resumer} at {world} ranks loading {saver}'s checkpoint")
            assert losses == pytest.approx(saved[saver][1], rel=1e-5, abs=1e-6), (resumer, world)


@pytest.mark.fast
def test_flat_boxes_tile_every_range_of_a_tensor_in_flat_order():
    for shape in ((), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 2)):
        numel = torch.Size(shape).numel()
        index = torch.arange(numel).view(shape)
        for lo, hi in itertools.combinations(range(numel + 1), 2):
            boxes = flat_boxes(shape, lo, hi)
            assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1), (shape, lo, hi, boxes)
            covered = []
            for offsets, sizes, start, end in boxes:
                cut = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else index
                assert torch.equal(cut.reshape(-1), torch.arange(start, end)), (shape, lo, hi, offsets, sizes)
                covered.append((start, end))
            assert covered and covered[0][0] == lo and covered[-1][1] == hi, (shape, lo, hi, covered)
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (shape, lo, hi, covered)


def _parity_engine(fmt: str = "zeroplus", n_blocks: int = 3) -> zeroplus.Engine:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}, "zeroplus": {"log_level": "warning", "memory_estimate": False,
                                                            "checkpoint_format": fmt}}
    return zeroplus.initialize(ParityNet(n_blocks=n_blocks), cfg)


@pytest.mark.fast
def test_the_dcp_format_round_trips_in_one_process_and_bad_uses_are_refused(tmp_path):
    """``zeroplus.checkpoint_format: dcp`` writes DCP (its ``.metadata``, no zeroplus metadata) that a fresh engine
    loads back bitwise with the step; a format that does not exist, an asynchronous DCP save and a client state
    are refused before anything is written; a DCP checkpoint of the model alone is refused with the way out
    (``load_optimizer_states=False``), which then loads the weights; another model's checkpoint names the
    parameters that differ."""
    path = str(tmp_path / "ckpt")
    engine = _parity_engine("dcp")
    engine_train(engine, make_batches(4, 2), 2, 0, 1, 1)
    final = engine.save_checkpoint(path)
    assert os.path.isfile(os.path.join(final, ".metadata")) and not os.path.exists(os.path.join(final, "metadata.json"))
    saved = {n: t.clone() for n, t in engine.consolidated_fp32_state().items()}
    states = {g.name: {k: torch.as_tensor(v).clone() for k, v in engine.optimizer_state(g).items()}
              for g in engine.partition.groups}
    again = _parity_engine()
    assert again.load_checkpoint(path)[0] == final and again.global_steps == 2
    assert all(torch.equal(again.consolidated_fp32_state()[n], t) for n, t in saved.items())
    for g in again.partition.groups:
        for k, v in again.optimizer_state(g).items():
            assert torch.equal(torch.as_tensor(v), states[g.name][k]), (g.name, k)
    for kwargs, says in (({"format": "npz"}, "'zeroplus' \\(default\\) or 'dcp'"),
                         ({"format": "dcp", "async_save": True}, "an asynchronous save cannot be saved as a DCP"),
                         ({"format": "dcp", "client_state": {"epoch": 1}}, "a client_state cannot")):
        with pytest.raises(ValueError, match=says):
            engine.save_checkpoint(path, tag="refused", **kwargs)
        assert not os.path.exists(os.path.join(path, "refused"))
    bare = str(tmp_path / "bare")
    dcp.save({"model": engine.module.state_dict()}, checkpoint_id=bare, no_dist=True)
    with pytest.raises(ValueError, match=r"holds no optimizer state for 'blocks.0.*load_optimizer_states=False"):
        again.load_checkpoint(bare)
    again.load_checkpoint(bare, load_optimizer_states=False)
    assert all(torch.equal(again.consolidated_fp32_state()[n], t) for n, t in saved.items())
    with pytest.raises(ValueError, match=r"unexpected parameters \['blocks.2"):
        _parity_engine(n_blocks=2).load_checkpoint(path)
