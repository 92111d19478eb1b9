"""Adam/AdamW moments in fp8 (e4m3) with a power-of-two scale per block (``zeroplus/kernels/block_fp8.py``,
``zeroplus.optimizer_states`` ``"fp8"``, ``block`` 128 or 256).

- The codec: a block's values within one e4m3 rounding (2^-4 relative, for values above 2^-6 of the block's
  largest) of the input; dequantized values exactly bf16 values; quantizing the dequantized block again gives the same
  real values (the checkpoint's round trip); a block of zeros, a short last block.
- The optimizer against a reference of the same rounding in one process: torch's fused AdamW on fp32 moments that
  are quantized and dequantized by the codec after every step (the second moment through its square root), over a
  tensor longer than one step chunk with a short last block: bit for bit.
- The engine at 2 ranks, stages 1-3: the ledger's ``optim_state`` is 1 byte per owned element and moment plus 4 per
  block, and a checkpoint resumes bit for bit at the same world size; at stage 3 the estimate predicts the states
  exactly and the losses stay within 2% of fp32 moments' (the main job's 300 steps: note 107).
- Stochastic rounding (the default for fp8): unbiased, on the two neighbours; the step with it bit for bit the
  reference drawing the same bits.
- Refused, naming the key: offloaded states or parameters.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.config import ConfigError
from zeroplus.kernels.block_fp8 import E4M3, blocks, dequantize_into, quantize
from zeroplus.ledger import Category
from zeroplus.optim import stored_states
from zeroplus.optim.stored_states import StoredStatesAdamW

FP8 = {"exp_avg": "fp8", "exp_avg_sq": "fp8"}


def _codec(x: torch.Tensor, block: int, step: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, scales = torch.empty(x.numel(), dtype=E4M3), torch.empty(blocks(x.numel(), block))
    quantize(x.clone(), values, scales, block, step)
    return values, scales, dequantize_into(torch.empty(x.numel()), values, scales, block)


@pytest.mark.parametrize("block", [128, 256])
def test_blocks_round_once_exactly_to_bf16_values_and_again_to_the_same(block):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5 * block + 37, generator=g) * torch.logspace(-3, 3, 5 * block + 37)
    x[block:2 * block] = 0  # a block of zeros
    values, scales, back = _codec(x, block)
    assert scales.numel() == 6 and scales[1] == 1 and torch.all(back[block:2 * block] == 0)
    assert torch.equal(back, back.bfloat16().float()), "every dequantized value is a bf16 value"
    assert torch.all(torch.log2(scales) == torch.log2(scales).round()), "power-of-two scales"
    for k in range(6):
        piece, got = x[k * block:(k + 1) * block], back[k * block:(k + 1) * block]
        big = piece.abs() >= piece.abs().max() / 64  # e4m3's normal range below the block's largest
        assert torch.all((got - piece)[big].abs() <= piece[big].abs() / 16), k
        assert got.abs().max() <= piece.abs().max() * (1 + 1 / 16)
    _, _, again = _codec(back, block)
    assert torch.equal(again, back), "quantizing a dequantized block gives the same values"


def test_stochastic_rounding_is_unbiased_and_lands_on_the_neighbours():
    """4096 draws (steps) of one block: each value lands on one of its two e4m3 neighbours and averages to itself
    within 3e-3 of a step; to nearest is off by up to half a step."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(128, generator=g) * 400 + 10
    x[0] = 448.0  # (the block's scale: 1)
    draws = torch.stack([_codec(x, 128, torch.tensor(float(k)))[2] for k in range(4096)])
    nearest = _codec(x, 128)[2]
    spacing = 2.0 ** (torch.floor(torch.log2(x)) - 3)  # e4m3: 3 mantissa bits
    assert torch.all(((draws - x).abs() < spacing).all(0))
    assert torch.all((draws.mean(0) - x).abs() <= 3e-2 * spacing)
    assert (nearest - x).abs().max() > 0.3 * spacing.max()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_step_is_fused_adamw_with_moments_rounded_by_the_codec(monkeypatch, rounding):
    """Over 2.5 step chunks (monkeypatched small) and a short last block, 4 steps: bit for bit the reference (fused
    AdamW, its moments passed through the codec with the step's draw)."""
    monkeypatch.setattr(stored_states, "CHUNK", 512)
    g = torch.Generator().manual_seed(1)
    n, block = 1280 + 77, 128
    start = torch.randn(n, generator=g)
    p, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = StoredStatesAdamW([p], lr=1e-2, weight_decay=0.01, fused=True, exp_avg_dtype=E4M3, exp_avg_sq_dtype=E4M3,
                            block=block, rounding=rounding)
    plain = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, fused=True)
    for k in range(1, 5):
        grad = torch.randn(n, generator=g) * torch.logspace(-4, 0, n)
        p.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        plain.step()
        state = plain.state[ref]
        step = torch.tensor(float(k)) if rounding == "stochastic" else None
        for a in range(0, n, 512):  # (the draw hashes the values: chunk by chunk as the step, the same blocks)
            m, v = state["exp_avg"][a:a + 512], state["exp_avg_sq"][a:a + 512]
            m.copy_(_codec(m, block, step)[2])
            v.copy_(_codec(v.sqrt(), block, step)[2].square())
        assert torch.equal(p, ref), k
    assert opt.state[p]["exp_avg"].dtype == E4M3 and opt.state[p]["exp_avg_sq_scale"].numel() == blocks(n, block)
    assert opt.state_bytes == 2 * (1 + 4 / block)


STEPS, MICRO = 4, 2


def _config(stage: int, states: dict | None, estimate: bool = False) -> dict:
    zp: dict = {"log_level": "warning", "memory_estimate": estimate}
    if states is not None:
        zp["optimizer_states"] = states
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "zeroplus": zp}


def _job(root: str) -> list[dict]:
    rank, world = rank_and_world()
    batches = make_batches(2 * STEPS * world, MICRO)
    out = []
    for stage in (1, 2, 3):
        row: dict = {"stage": stage}
        for name, states in ((("fp32", None),) if stage == 3 else ()) + (("fp8", FP8),):
            torch.manual_seed(0)
            engine = zeroplus.initialize(ParityNet(), _config(stage, states, estimate=name == "fp8" and stage == 3))
            row[name] = engine_train(engine, batches, STEPS, rank, world, 1)
            if name == "fp8":
                owned = [g.owned_numel for g in engine.partition.groups]
                row["states"] = engine.ledger.live_bytes(Category.OPTIM_STATE)
                # 1 byte an element and 4 a block, each moment (the ledger counts no one-element tensor: a step count,
                # the scale of a shard of one block)
                row["formula"] = sum(2 * (n + (4 * blocks(n, 128) if blocks(n, 128) > 1 else 0)) for n in owned)
                if engine.budget is not None:
                    row["predicted"] = engine.budget.category_peaks[Category.OPTIM_STATE.value]
                    row["peak"] = engine.ledger.peak_bytes(Category.OPTIM_STATE)
                engine.save_checkpoint(f"{root}/{stage}")
                row["straight"] = engine_train(engine, batches, STEPS, rank, world, 1, start=STEPS)
                engine.destroy()
                torch.manual_seed(1)
                resumed = zeroplus.initialize(ParityNet(), _config(stage, FP8))
                resumed.load_checkpoint(f"{root}/{stage}")
                row["resumed"] = engine_train(resumed, batches, STEPS, rank, world, 1, start=STEPS)
                resumed.destroy()
            else:
                engine.destroy()
        out.append(row)
    return out


def test_fp8_moments_at_every_stage_on_two_ranks(tmp_path):
    """Also: the stage-1 checkpoint loads into one rank, which cuts other blocks: the moments saved one value per
    element (bf16) are quantized again with its blocks (a documented rounding), and it goes on from the saved step
    with the saved weights (its next forward's loss is the two ranks' straight run's)."""
    runs = run_distributed(_job, 2, str(tmp_path))
    loaded = run_distributed(_load_at_one_rank, 1, str(tmp_path))[0]
    assert loaded["exp_avg"] == torch.bfloat16 and loaded["steps"] == STEPS
    first = runs[0][0]["straight"][0]
    assert abs(loaded["loss"] - first) <= 1e-6 * abs(first), (loaded, first)
    for rank_rows in runs:
        for row in rank_rows:
            label = f"ZeRO-{row['stage']}"
            assert row["states"] == row["formula"], (label, row["states"], row["formula"])
            if "predicted" in row:
                assert row["predicted"] == row["peak"], (label, row["predicted"], row["peak"])
            for ours, fp32 in zip(row["fp8"], row.get("fp32", row["fp8"])):  # (stage 3 against fp32 moments)
                assert abs(ours - fp32) <= 0.02 * fp32, (label, row["fp8"], row.get("fp32"))
            assert row["resumed"] == row["straight"], f"{label}: the resumed run's losses"


@pytest.mark.parametrize("zero,says", [
    ({"offload_optimizer": {"device": "cpu"}}, "'zero_optimization.offload_optimizer' steps or moves the states"),
    ({"offload_param": {"device": "cpu"}, "stage": 3}, "'zero_optimization.offload_param' steps or moves the states"),
])
def test_what_fp8_moments_cannot_do_is_refused_naming_the_key(zero, says):
    cfg = _config(2, FP8)
    cfg["zero_optimization"].update(zero)
    with pytest.raises(ConfigError, match=says):
        zeroplus.initialize(ParityNet(), cfg)


def _load_at_one_rank(root: str) -> dict:
    """The stage-1 checkpoint two ranks saved, loaded by one: its fp8 moments requantized with one rank's blocks."""
    torch.manual_seed(1)
    engine = zeroplus.initialize(ParityNet(), _config(1, FP8))
    engine.load_checkpoint(f"{root}/1")
    state = engine.optimizer_state(engine.partition.groups[0])
    batches = make_batches(2 * STEPS * 2, MICRO)
    losses = [engine(*batches[(STEPS + s) * 2]) for s in range(1)]  # (the forward of the next step's batch)
    return {"exp_avg": state["exp_avg"].dtype, "loss": float(losses[0]), "steps": engine.global_steps}

