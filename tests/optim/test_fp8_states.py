"""Adam/AdamW moments in fp8 (e4m3) with a power-of-two scale per block (``zeroplus/kernels/block_fp8.py``,
``zeroplus.optimizer_states`` ``"fp8"``, ``block`` 128 or 256: fp32 scales; ``"mxfp8"``: an e8m0 scale per 32).

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
- mxfp8: the codec with e8m0 scales equals the fp32-scaled one at 32 elements a block, bit for bit (its scales no
  smaller than 2^-127); the step bit for bit the reference; at 2 ranks and stage 3, 1 byte an element and 1 a block,
  predicted exactly, and a bit-exact resume.
- Masters stepped in chunks (split, on a tier, bf16): the chunks start at multiples of the block.
- Refused, naming the key: fp8 beside mxfp8; mxfp8 with another block.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.config import ConfigError
from zeroplus.kernels.block_fp8 import E4M3, E8M0, MX_BLOCK, blocks, dequantize_into, quantize, root_
from zeroplus.ledger import Category
from zeroplus.optim import stored_states
from zeroplus.optim.stored_states import StoredStatesAdamW

FP8 = {"exp_avg": "fp8", "exp_avg_sq": "fp8"}
MXFP8 = {"exp_avg": "mxfp8", "exp_avg_sq": "mxfp8"}


def _codec(x: torch.Tensor, block: int, step: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.float32
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = torch.empty(x.numel(), dtype=E4M3)
    scales = torch.empty(blocks(x.numel(), block), dtype=scale_dtype)
    quantize(x.clone(), values, scales, block, step)
    return values, scales.float(), dequantize_into(torch.empty(x.numel()), values, scales, block)


@pytest.mark.parametrize("block,scale_dtype", [(128, torch.float32), (256, torch.float32), (MX_BLOCK, E8M0)])
def test_blocks_round_once_exactly_to_bf16_values_and_again_to_the_same(block, scale_dtype):
    g = torch.Generator().manual_seed(0)
    n = 5 * block + 37 % block  # (a short last block)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    x[block:2 * block] = 0  # a block of zeros
    values, scales, back = _codec(x, block, scale_dtype=scale_dtype)
    assert scales.numel() == 6 and scales[1] == 1 and torch.all(back[block:2 * block] == 0)
    assert torch.equal(back, back.bfloat16().float()), "every dequantized value is a bf16 value"
    assert torch.all(torch.log2(scales) == torch.log2(scales).round()), "power-of-two scales"
    for k in range(6):
        piece, got = x[k * block:(k + 1) * block], back[k * block:(k + 1) * block]
        big = piece.abs() >= piece.abs().max() / 64  # e4m3's normal range below the block's largest
        assert torch.all((got - piece)[big].abs() <= piece[big].abs() / 16), k
        assert got.abs().max() <= piece.abs().max() * (1 + 1 / 16)
    _, _, again = _codec(back, block, scale_dtype=scale_dtype)
    assert torch.equal(again, back), "quantizing a dequantized block gives the same values"


def test_mxfp8s_e8m0_scales_are_the_fp32_scales_of_32_elements_down_to_2_to_the_minus_127():
    """The same values and real scales as fp32 scales at 32 elements a block, over 60 orders of magnitude; a block
    too small for a scale of 2^-127 (e8m0's least) keeps that scale and rounds its values as e4m3 subnormals, where an
    fp32 scale would go lower."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32 * 40 + 5, generator=g) * torch.logspace(-30, 30, 32 * 40 + 5)
    ours, theirs = _codec(x, MX_BLOCK, scale_dtype=E8M0), _codec(x, MX_BLOCK)
    assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8)) and torch.equal(ours[1], theirs[1])
    assert torch.equal(ours[2], theirs[2])
    tiny = torch.full((MX_BLOCK,), 1e-40)  # (an fp32 subnormal: its fp32 scale would be 2^-141)
    values, scales, back = _codec(tiny, MX_BLOCK, scale_dtype=E8M0)
    assert scales.item() == 2.0 ** -127 and _codec(tiny, MX_BLOCK)[1].item() == 2.0 ** -141
    assert torch.all((back - tiny).abs() <= 2.0 ** -137), "within half an e4m3 subnormal step (2^-9) of 2^-127"


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


@pytest.mark.parametrize("block,scale_dtype", [(128, torch.float32), (MX_BLOCK, E8M0)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_step_is_fused_adamw_with_moments_rounded_by_the_codec(monkeypatch, rounding, block, scale_dtype):
    """Over 2.5 step chunks (monkeypatched small) and a short last block, 4 steps: bit for bit the reference (fused
    AdamW, its moments passed through the codec with the step's draw); fp8 and mxfp8."""
    monkeypatch.setattr(stored_states, "CHUNK", 512)
    g = torch.Generator().manual_seed(1)
    n = 1280 + 77
    start = torch.randn(n, generator=g)
    p, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = StoredStatesAdamW([p], lr=1e-2, weight_decay=0.01, fused=True, exp_avg_dtype=E4M3, exp_avg_sq_dtype=E4M3,
                            block=block, rounding=rounding, scale_dtype=scale_dtype)
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
            v.copy_(_codec(root_(v.clone()), block, step)[2].square())
        assert torch.equal(p, ref), k
    assert opt.state[p]["exp_avg"].dtype == E4M3 and opt.state[p]["exp_avg_sq_scale"].numel() == blocks(n, block)
    assert opt.state[p]["exp_avg_sq_scale"].dtype == scale_dtype
    assert opt.state_bytes == 2 * (1 + scale_dtype.itemsize / block)


@pytest.mark.parametrize("block,scale_dtype", [(128, torch.float32), (MX_BLOCK, E8M0)])
def test_a_state_dict_loads_back_in_the_stored_form_and_steps_on_bit_for_bit(block, scale_dtype):
    """torch's ``load_state_dict`` casts every floating state to the parameter's dtype; the stored moments and their
    scales go back to theirs (exactly: e4m3 and power-of-two values), and the next steps equal the uninterrupted
    optimizer's."""
    g = torch.Generator().manual_seed(3)
    n = 3 * block + 5
    kwargs = dict(lr=1e-2, fused=True, exp_avg_dtype=E4M3, exp_avg_sq_dtype=E4M3, block=block, rounding="stochastic",
                  scale_dtype=scale_dtype)
    p = torch.nn.Parameter(torch.randn(n, generator=g))
    opt = StoredStatesAdamW([p], **kwargs)
    grads = [torch.randn(n, generator=g) for _ in range(4)]
    for grad in grads[:2]:
        p.grad = grad.clone()
        opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    other = StoredStatesAdamW([q], **kwargs)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))  # (as from a file: torch's keeps a tensor of its dtype)
    assert other.state[q]["exp_avg_scale"].dtype == other.state[q]["exp_avg_sq_scale"].dtype == scale_dtype
    assert other.state[q]["exp_avg"].dtype == E4M3
    # what a step holds: two fp32 moments, the hash's two int32 rows and the root's double, as long as the parameter
    # (shorter than a chunk),
    # or, where the native loop steps its whole blocks, as the last block and the few elements torch's kernel ends on
    chunked = n if opt.native is None else n - opt.native.covered_blocks(n, block)
    assert opt.workspace_bytes == (4 * 4 + 8) * chunked and (opt.native is None or chunked < block + 16)  # (+ root_'s)
    # the estimate's stand-in (meta, unfused) predicts that for the CPU, and the whole parameter for a device
    meta = StoredStatesAdamW([torch.nn.Parameter(torch.empty(n, device="meta"))], **dict(kwargs, fused=False))
    assert meta.native is None and meta.workspace_bytes == (4 * 4 + 8) * n
    assert meta.predicted_workspace_bytes(on_cpu=True) == opt.workspace_bytes
    assert meta.predicted_workspace_bytes(on_cpu=False) == (4 * 4 + 8) * n
    for grad in grads[2:]:
        p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        other.step()
    assert torch.equal(p, q)


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
        if stage == 3:  # (the reference the losses are held to)
            torch.manual_seed(0)
            engine = zeroplus.initialize(ParityNet(), _config(stage, None))
            row["fp32"] = engine_train(engine, batches, STEPS, rank, world, 1)
            engine.destroy()
        # fp8 at every stage (4 bytes a block of 128 for its scale), mxfp8 at stage 3 (1 byte a block of 32)
        formats = [("fp8", FP8, 128, 4)] + ([("mxfp8", MXFP8, MX_BLOCK, 1)] if stage == 3 else [])
        for name, states, block, scale_bytes in formats:
            torch.manual_seed(0)
            engine = zeroplus.initialize(ParityNet(), _config(stage, states, estimate=stage == 3))
            got: dict = {"losses": engine_train(engine, batches, STEPS, rank, world, 1)}
            owned = [g.owned_numel for g in engine.partition.groups]
            got["states"] = engine.ledger.live_bytes(Category.OPTIM_STATE)
            # 1 byte an element and the scales a block, each moment (the ledger counts no one-element tensor: a step
            # count, the scale of a shard of one block)
            got["formula"] = sum(2 * (n + (scale_bytes * blocks(n, block) if blocks(n, block) > 1 else 0))
                                 for n in owned)
            if engine.budget is not None:
                got["predicted"] = engine.budget.category_peaks[Category.OPTIM_STATE.value]
                got["peak"] = engine.ledger.peak_bytes(Category.OPTIM_STATE)
            saved = f"{root}/{stage}" if name == "fp8" else f"{root}/{name}{stage}"
            engine.save_checkpoint(saved)
            got["straight"] = engine_train(engine, batches, STEPS, rank, world, 1, start=STEPS)
            engine.destroy()
            torch.manual_seed(1)
            resumed = zeroplus.initialize(ParityNet(), _config(stage, states))
            resumed.load_checkpoint(saved)
            got["resumed"] = engine_train(resumed, batches, STEPS, rank, world, 1, start=STEPS)
            got["resumed_states"] = resumed.ledger.live_bytes(Category.OPTIM_STATE)  # (loaded in the stored form)
            resumed.destroy()
            row[name] = got
        out.append(row)
    return out


def test_fp8_moments_at_every_stage_on_two_ranks(tmp_path):
    """Also: the stage-1 checkpoint loads into one rank, which cuts other blocks: the moments saved one value per
    element (bf16) are quantized again with its blocks (a documented rounding), and it goes on from the saved step
    with the saved weights (its next forward's loss is the two ranks' straight run's). mxfp8 at stage 3 alike."""
    runs = run_distributed(_job, 2, str(tmp_path))
    loaded = run_distributed(_load_at_one_rank, 1, str(tmp_path))[0]
    assert loaded["exp_avg"] == torch.bfloat16 and loaded["steps"] == STEPS
    first = runs[0][0]["fp8"]["straight"][0]
    assert abs(loaded["loss"] - first) <= 1e-6 * abs(first), (loaded, first)
    for rank_rows in runs:
        for row in rank_rows:
            for name in ("fp8", "mxfp8"):
                if name not in row:
                    continue
                got, label = row[name], f"ZeRO-{row['stage']} {name}"
                assert got["states"] == got["resumed_states"] == got["formula"], (label, got)
                if "predicted" in got:
                    assert got["predicted"] == got["peak"], (label, got["predicted"], got["peak"])
                for ours, fp32 in zip(got["losses"], row.get("fp32", got["losses"])):  # (stage 3: fp32 moments)
                    assert abs(ours - fp32) <= 0.02 * fp32, (label, got["losses"], row.get("fp32"))
                assert got["resumed"] == got["straight"], f"{label}: the resumed run's losses"
            assert row["stage"] != 3 or "predicted" in row["mxfp8"]


def _chunked_run(stage: int, states: dict, like_shared: bool = False, shared: bool = False,
                 offload: str | None = None, masters: str | None = None) -> tuple:
    """One rank in bf16, 4 steps of ParityNet, masters stepped in chunks of 100 elements where they are stepped in
    chunks (rounded down to the block): losses, the masters, the moments one value per element, optim_state bytes."""
    torch.manual_seed(0)
    cfg = _config(stage, states)
    cfg["bf16"] = {"enabled": True}
    cfg["zeroplus"].update(master_step_chunk=100, shared_master_weights=shared,
                           master_rounding="like_shared" if like_shared else "nearest_even")
    if masters is not None:
        cfg["zeroplus"]["master_weights"] = {"dtype": masters}
    if offload is not None:
        cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": offload}
    engine = zeroplus.initialize(ParityNet(), cfg)
    losses = engine_train(engine, make_batches(STEPS, MICRO), STEPS, 0, 1, 1)
    moments = [engine.optimizer_state(g)[key].float() for g in engine.partition.groups
               for key in ("exp_avg", "exp_avg_sq")]
    out = (losses, engine.consolidated_fp32_state(), moments, engine.ledger.live_bytes(Category.OPTIM_STATE))
    engine.destroy()
    return out


def _same(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and a[3] == b[3] and all(torch.equal(a[1][n], b[1][n]) for n in a[1])
            and all(torch.equal(x, y) for x, y in zip(a[2], b[2])))


@pytest.mark.parametrize("states", [FP8, MXFP8])
def test_split_tiered_and_bf16_masters_step_fp8_moments_in_chunks_of_whole_blocks(tmp_path, states):
    """Masters read and written chunk by chunk (``chunked_step.py``) give each chunk its blocks' slice of the scales,
    the chunks starting at multiples of the block: a master on a tier (stage 3) and a shared (split) master each train
    bit for bit as a resident fp32 master rounded the same way (losses, masters, moments, bytes); bf16 masters train
    within 2% of it."""
    assert _same(_chunked_run(3, states, offload=str(tmp_path)), _chunked_run(3, states)), "master on a tier"
    separate = _chunked_run(1, states, like_shared=True)
    assert _same(_chunked_run(1, states, like_shared=True, shared=True), separate), "shared master"
    bf16_masters = _chunked_run(1, states, masters="bf16")[0]
    assert all(abs(ours - theirs) <= 0.02 * abs(theirs) for ours, theirs in zip(bf16_masters, separate[0])), (
        bf16_masters, separate[0])


@pytest.mark.parametrize("states,says", [
    ({"exp_avg": "fp8", "exp_avg_sq": "mxfp8"}, "one moment in fp8 and the other in mxfp8"),
    ({**MXFP8, "block": 256}, "'zeroplus.optimizer_states.block' is 256, and mxfp8 moments have a scale per 32"),
])
def test_mixed_or_reblocked_mxfp8_is_refused_naming_the_key(states, says):
    with pytest.raises(ConfigError, match=says):
        zeroplus.initialize(ParityNet(), _config(2, states))


def _load_at_one_rank(root: str) -> dict:
    """The stage-1 checkpoint two ranks saved, loaded by one: its fp8 moments requantized with one rank's blocks."""
    torch.manual_seed(1)
    engine = zeroplus.initialize(ParityNet(), _config(1, FP8))
    engine.load_checkpoint(f"{root}/1")
    state = engine.optimizer_state(engine.partition.groups[0])
    batches = make_batches(2 * STEPS * 2, MICRO)
    losses = [engine(*batches[(STEPS + s) * 2]) for s in range(1)]  # (the forward of the next step's batch)
    return {"exp_avg": state["exp_avg"].dtype, "loss": float(losses[0]), "steps": engine.global_steps}

