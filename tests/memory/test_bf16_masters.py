"""bf16 master weights (``zeroplus.master_weights``, DeepSpeed's ``bf16.bf16_master_weights_and_grads``): the master is
the bf16 weight itself, stepped in fp32 and stored back rounded to nearest or stochastically.

The reference is the plain module in bf16 with the same step written out in one process (``Bf16MasterReference``:
each parameter widened to fp32, torch's fused AdamW over it with the gradient widened, stored back with
``kernels/stochastic_round.store`` and the same step count). At one rank every stage equals it bit for bit to nearest
(stochastically, within a bf16 step: see the test); at two ranks stages 2 and 3 equal each other bit for bit, and every
stage's weights stay within bf16 rounding of the one-process reference over the same batches. The ledger's ``master``
bytes: none at stages 0-2 (the bf16 weights are the masters), 2 per owned element at stage 3 (the shard the
all-gathers send). Stochastic rounding keeps updates below half a bf16 step in expectation, where rounding to nearest
loses every one of them; a resumed run draws as the uninterrupted one; zeroplus's and DCP checkpoints keep the bf16
masters and moments and load into fp32 ones exactly.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.config import ConfigError
from zeroplus.kernels.stochastic_round import store
from zeroplus.ledger import Category

STEPS, MICRO, LR = 4, 2, 1e-2


def _config(stage: int, rounding: str, deepspeed_key: bool = False) -> dict:
    zp: dict = {"log_level": "warning", "memory_estimate": False, "master_step_chunk": 48}
    bf16: dict = {"enabled": True}
    if deepspeed_key:
        bf16["bf16_master_weights_and_grads"] = True
        zp["master_weights"] = {"rounding": rounding}
    else:
        zp["master_weights"] = {"dtype": "bf16", "rounding": rounding}
    return {"train_micro_batch_size_per_gpu": MICRO, "bf16": bf16,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0},
            "zeroplus": zp}


class Bf16MasterReference:
    """The plain module's bf16 parameters stepped as bf16 masters: widened, torch's fused AdamW, stored rounded."""

    def __init__(self, params: list[torch.nn.Parameter], rounding: str) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.work = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32)) for p in self.params]
        self.opt = torch.optim.AdamW(self.work, lr=LR, weight_decay=0.01, fused=True)
        self.rounding = rounding
        self.count = torch.zeros((), dtype=torch.int32)

    @torch.no_grad()
    def step(self, scale: float = 1.0) -> None:
        self.count += 1
        for p, w in zip(self.params, self.work):
            w.copy_(p)
            w.grad = p.grad.float() * scale if scale != 1.0 else p.grad.float()
        self.opt.step()
        for p, w in zip(self.params, self.work):
            store(p.view(-1), w.view(-1), self.rounding, self.count)
            p.grad = None


def _reference(rounding: str, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process run over every rank's micro-batch of each step (the mean loss of the ranks' means)."""
    torch.manual_seed(0)
    model = ParityNet().to(torch.bfloat16)
    ref = Bf16MasterReference(list(model.parameters()), rounding)
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for r in range(world):
            x, y = batches[step * world + r]
            loss = model(x, y) / world
            loss.backward()
            total += loss.item()
        ref.step()
        losses.append(total)
    return losses, {n: p.detach().float() for n, p in model.named_parameters() if p.requires_grad}


def _train(stage: int, rounding: str, deepspeed_key: bool = False) -> dict:
    return _train_config(_config(stage, rounding, deepspeed_key))


def _train_config(cfg: dict) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), cfg)
    master_bytes = engine.ledger.live_bytes(Category.MASTER)
    batches = make_batches(STEPS * world, MICRO)
    losses = []
    for step in range(STEPS):
        x, y = batches[step * world + rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.consolidated_fp32_state()
    owned = sum(g.owned_numel for g in engine.partition.groups if g.trainable)
    engine.destroy()
    return {"losses": losses, "state": state, "master_bytes": master_bytes, "owned": owned}


def _stages(rounding: str) -> list[dict]:
    return [_train(stage, rounding, deepspeed_key=stage == 2) for stage in range(4)]


def _within_a_bf16_step(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], most: float) -> None:
    """Every weight within three bf16 steps of ``want``'s (``eps`` times its magnitude: 2-4 of its spacings; 2.1
    measured), at most ``most`` of them apart (3.8% measured)."""
    apart = total = 0
    for name, value in want.items():
        step = torch.finfo(torch.bfloat16).eps * value.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert bool((got[name] - value).abs().le(3 * step).all()), f"{name}: more than 3 bf16 steps from the reference"
        apart += int(got[name].ne(value).sum())
        total += value.numel()
    assert apart <= most * total, f"{apart} of {total} weights apart"


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_one_rank_every_stage_equals_the_plain_bf16_module_stepped_the_same_way(rounding):
    """To nearest: bit for bit. Stochastically: the stages bit for bit with each other, and within a bf16 step of
    the reference, where a few elements rounded the other way: the fused kernel's fp32 result differs in its last bit
    between an element in its vector loop and one in its scalar tail (the flat chunks and the parameters end at
    different places), and the hash of a different value draws differently (3.8% of the weights here, by 2 steps at
    most)."""
    ref_losses, ref_state = _reference(rounding, 1)
    assert ref_state["blocks.0.up.weight"].ne(ParityNet().blocks[0].up.weight).any()  # (it trained)
    runs = _stages(rounding)
    for stage, run in enumerate(runs):
        # the bf16 weights are the masters: nothing beside them at stages 0-2, the 2-byte shard at stage 3
        assert run["master_bytes"] == (2 * run["owned"] if stage == 3 else 0), (stage, run["master_bytes"])
        assert run["losses"] == runs[0]["losses"], (stage, run["losses"], runs[0]["losses"])
        for name, value in runs[0]["state"].items():
            assert torch.equal(run["state"][name], value), f"stage {stage} {rounding}: {name}"
    if rounding == "nearest":
        assert runs[0]["losses"] == ref_losses, (runs[0]["losses"], ref_losses)
    torch.testing.assert_close(runs[0]["losses"], ref_losses, rtol=1e-5, atol=0)
    if rounding == "nearest":
        for name, value in ref_state.items():
            assert torch.equal(runs[0]["state"][name], value), name
    else:
        _within_a_bf16_step(runs[0]["state"], ref_state, most=0.06)


def _accumulating(stage: int) -> dict:
    """One rank, 2 micro-batches a step (DeepSpeed's key), to nearest: the weights and the gradients' peak bytes."""
    cfg = _config(stage, "nearest", deepspeed_key=True)
    cfg["gradient_accumulation_steps"] = 2
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), cfg)
    batches = make_batches(STEPS * 2, MICRO)
    for step in range(STEPS):
        for micro in range(2):
            engine.backward(engine(*batches[step * 2 + micro]))
            engine.step()
    out = {"state": engine.consolidated_fp32_state(), "grad_peak": engine.ledger.peak_bytes(Category.GRAD),
           "owned": sum(g.owned_numel for g in engine.partition.groups if g.trainable)}
    engine.destroy()
    return out


def test_gradients_accumulate_in_bf16_under_bf16_masters():
    """DeepSpeed's ``bf16_master_weights_and_grads`` keeps the gradients in bf16: over two micro-batches a step, stages
    2-3 add each reduced gradient into a bf16 shard, as stages 0-1 add into their bf16 flat gradient, so every stage
    trains bit for bit alike and holds the same gradient bytes (one rank: 9266 bytes at every stage; stages 2-3
    accumulated in fp32 before, 15646 bytes and 221 of 3671 weights apart)."""
    runs = [_accumulating(stage) for stage in range(4)]
    for stage, run in enumerate(runs):
        for name, value in runs[0]["state"].items():
            assert torch.equal(run["state"][name], value), f"stage {stage}: {name}"
        assert run["grad_peak"] == runs[0]["grad_peak"], (stage, run["grad_peak"], runs[0]["grad_peak"])


def test_two_ranks_stages_that_reduce_alike_equal_bitwise_and_all_within_bf16_rounding():
    """Stages 2 and 3 reduce-scatter the bf16 gradient and shard alike: bit for bit (stage 3's master its own copy,
    stage 2's a view of the full weights). Stages 0 and 1 all-reduce it, which rounds differently in bf16 (as with
    fp32 masters), and stage 0 steps the whole group, so the fused kernel's vector loop and scalar tail fall on other
    elements (see the one-rank test): within three bf16 steps of stage 1, a few apart."""
    runs = run_distributed(_stages, 2, "stochastic")
    _, ref_state = _reference("stochastic", 2)
    for rank, stages in enumerate(runs):
        for stage, run in enumerate(stages):
            assert run["master_bytes"] == (2 * run["owned"] if stage == 3 else 0), (stage, run["master_bytes"])
        assert stages[3]["losses"] == stages[2]["losses"], rank
        for name, value in stages[2]["state"].items():
            assert torch.equal(stages[3]["state"][name], value), f"rank {rank}: {name}"
    _within_a_bf16_step(runs[0][0]["state"], runs[0][1]["state"], most=0.06)
    # the ranks' mean of bf16 gradients against one process's bf16 gradient of the mean: apart by bf16 rounding, which
    # Adam's normalised step turns into up to 2 lr a step where a gradient is near zero (a bound, not a tight check)
    for stage in range(4):
        for name, value in ref_state.items():
            torch.testing.assert_close(runs[0][stage]["state"][name], value, rtol=0, atol=2 * STEPS * LR, msg=name)


def _tiny_updates(rounding: str) -> tuple[float, float]:
    """SGD with a constant gradient whose update is an eighth of a bf16 step: 4096 weights at 64 distinct bf16 values
    in [1, 1.5) (the same value at the same step rounds the same way: 64 independent draws), 256 steps. Returns the
    mean movement and what it would be if every update were kept (32 steps' worth)."""
    ulp = 2.0 ** -7  # bf16's step in [1, 2)
    lr = ulp / 8

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(1 + (torch.arange(4096) % 64) * ulp)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return -(self.weight * x).sum()  # the gradient is -x: a step of +lr per element

    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "SGD", "params": {"lr": lr}},
           "zero_optimization": {"stage": 1},
           "zeroplus": {"log_level": "warning", "memory_estimate": False,
                        "master_weights": {"dtype": "bf16", "rounding": rounding}}}
    model = Scaled()
    start = model.weight.detach().clone()
    engine = zeroplus.initialize(model, cfg)
    x = torch.ones(4096, dtype=torch.bfloat16)
    for _ in range(256):
        engine.backward(engine(x))
        engine.step()
    moved = engine.consolidated_fp32_state()["weight"].sub(start).mean().item()
    engine.destroy()
    return moved, 256 * lr


def test_stochastic_rounding_keeps_updates_below_half_a_step_where_nearest_loses_them():
    """Expected movement 32 bf16 steps; 64 independent draws of 256 Bernoulli(1/8) steps each put the mean within
    about 2% of it (one standard deviation): 10% is five."""
    lost, expected = _tiny_updates("nearest")
    kept, _ = _tiny_updates("stochastic")
    assert lost == 0.0, lost
    assert abs(kept - expected) < 0.10 * expected, (kept, expected)


def _resume(root: str) -> tuple[dict, dict]:
    """Stage 3, stochastic: two steps, a save, two more; then a new engine loads the save and takes the two."""
    rank, world = rank_and_world()
    batches = make_batches(STEPS * world, MICRO)

    def steps(engine, start: int) -> None:
        for step in range(start, STEPS):
            x, y = batches[step * world + rank]
            engine.backward(engine(x, y))
            engine.step()

    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(3, "stochastic"))
    for step in range(STEPS // 2):
        x, y = batches[step * world + rank]
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(root, tag="half")
    steps(engine, STEPS // 2)
    whole = engine.consolidated_fp32_state()
    engine.destroy()
    torch.manual_seed(1)
    engine = zeroplus.initialize(ParityNet(), _config(3, "stochastic"))
    engine.load_checkpoint(root, tag="half")
    steps(engine, STEPS // 2)
    resumed = engine.consolidated_fp32_state()
    engine.destroy()
    return whole, resumed


def test_a_resumed_run_rounds_as_the_uninterrupted_one(tmp_path):
    """The masters save as their fp32 values (exact: bf16 widened) and the stochastic draws follow the step count
    the checkpoint restores: bit for bit."""
    for whole, resumed in run_distributed(_resume, 2, str(tmp_path)):
        for name, value in whole.items():
            assert torch.equal(resumed[name], value), name


def test_with_offloaded_optimizer_states_it_trains_as_with_resident_ones(tmp_path):
    """One rank, stage 1, the states in files streamed in sub-groups (``chunked_step.step_tiered``): bit for bit."""
    runs = []
    for offload in (False, True):
        cfg = _config(1, "stochastic")
        if offload:
            cfg["zero_optimization"].update(sub_group_size=40, offload_optimizer={
                "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
        runs.append(_train(1, "stochastic") if not offload else _train_config(cfg))
    assert runs[0]["losses"] == runs[1]["losses"]
    for name, value in runs[0]["state"].items():
        assert torch.equal(runs[1]["state"][name], value), name


def _low(fmt: str, low: bool = True) -> zeroplus.Engine:
    cfg = _config(2, "stochastic")
    cfg["zeroplus"]["checkpoint_format"] = fmt
    if low:
        cfg["zeroplus"]["optimizer_states"] = {"exp_avg": "bf16", "exp_avg_sq": "bf16"}
    else:
        del cfg["zeroplus"]["master_weights"]
    torch.manual_seed(0)
    return zeroplus.initialize(ParityNet(), cfg)


@pytest.mark.parametrize("fmt", ["zeroplus", "dcp"])
def test_checkpoints_keep_bf16_masters_and_moments_and_load_into_fp32_ones(tmp_path, fmt):
    """One rank, stage 2, bf16 masters and bf16 moments, in zeroplus's format and DCP: a fresh engine loads them
    bitwise (the moments stay bf16) and continues as the saving one does; an engine with fp32 masters and moments
    loads the same checkpoint as those values widened (exact)."""
    batches = make_batches(4, MICRO)
    engine = _low(fmt)
    engine_train(engine, batches, 2, 0, 1, 1)
    engine.save_checkpoint(str(tmp_path))
    saved = engine.consolidated_fp32_state()
    states = {g.name: {k: torch.as_tensor(v).clone() for k, v in engine.optimizer_state(g).items()}
              for g in engine.partition.groups}
    assert {v.dtype for st in states.values() for k, v in st.items() if k != "step"} == {torch.bfloat16}
    engine_train(engine, batches, 2, 0, 1, 1, start=2)
    after = engine.consolidated_fp32_state()
    for low in (True, False):
        again = _low(fmt, low)
        again.load_checkpoint(str(tmp_path))
        for name, value in saved.items():
            assert torch.equal(again.consolidated_fp32_state()[name], value), (fmt, low, name)
        for g in again.partition.groups:
            for k, v in again.optimizer_state(g).items():
                want = states[g.name][k]
                assert torch.equal(torch.as_tensor(v), want.to(torch.as_tensor(v).dtype)), (fmt, low, g.name, k)
                assert k == "step" or torch.as_tensor(v).dtype == (torch.bfloat16 if low else torch.float32)
        if low:
            engine_train(again, batches, 2, 0, 1, 1, start=2)
            for name, value in after.items():
                assert torch.equal(again.consolidated_fp32_state()[name], value), (fmt, "continued", name)


def _refused(cfg: dict) -> str:
    try:
        zeroplus.initialize(ParityNet(), cfg)
    except ConfigError as err:
        return str(err)
    return "initialized"


def test_what_bf16_masters_cannot_serve_is_refused_naming_the_key_and_rank():
    fp32 = _config(1, "nearest")
    fp32["bf16"] = {"enabled": False}
    said = _refused(fp32)
    assert "'zeroplus.master_weights.dtype' on rank 0" in said and "need bf16 training" in said, said
    ds = _config(1, "nearest", deepspeed_key=True)
    ds["zeroplus"]["shared_master_weights"] = True
    said = _refused(ds)
    assert "'bf16.bf16_master_weights_and_grads' on rank 0" in said and "shared_master_weights" in said, said
    offload = _config(3, "nearest")
    offload["zero_optimization"]["offload_param"] = {"device": "cpu"}
    said = _refused(offload)
    assert "offload_param" in said, said
