"""Optimizer-state offload (``zero_optimization.offload_optimizer``) changes no number.

On 2 ranks at stages 1-3, with the states in files (``device: nvme``) streamed in sub-groups of
40 elements through a window of 3: losses and fp32 masters bitwise equal to the run without
offload, in fp32, bf16 and fp16 (dynamic loss scaling), at ratio 1 and 0.5, with shared-storage master weights, and with
Adam's moments stored in bf16 (``zeroplus.optimizer_states``: half the bytes on the tier and through the window) or fp8
(a quarter and the scales; the sub-groups start at multiples of 128, the block, so each keeps the shard's blocks). The
ledger keeps no ``optim_state`` bytes resident at ratio 1 (part at 0.5) and at most the
window's worth in ``offload_buffer`` (3 sub-groups read or stepping and 3 being written, over all
groups together), not the shard's. A checkpoint saved with offloaded states resumes
bit for bit, with or without offload (fp8 moments saved one value per element and quantized again per sub-group);
bad settings are errors naming the key.
"""
from __future__ import annotations

import os

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.ledger import Category, Ledger
from zeroplus.offload.optimizer_states import TieredStates, Window

SUB = 40


def _config(stage: int, dtype: str, path: str | None, ratio: float = 1.0, shared: bool = False,
            states: str | None = None) -> dict:
    """``states``: the dtype Adam's moments are stored in (``zeroplus.optimizer_states``), unset: fp32."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if path is not None:
        os.makedirs(path, exist_ok=True)  # zeroplus does not create offload directories
        zero.update(sub_group_size=SUB, offload_optimizer={"device": "nvme", "nvme_path": path, "ratio": ratio,
                                                             "buffer_count": 3})
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": zero,
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "shared_master_weights": shared,
                         "optimizer_states": {"exp_avg": states, "exp_avg_sq": states} if states else {}}}


def _run(cfg: dict, steps: int = 4) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), cfg)
    losses = engine_train(engine, make_batches(steps * world, 2), steps, rank, world, 1)
    return {"losses": losses, "masters": engine.consolidated_fp32_state(),
            "resident": engine.ledger.live_bytes(Category.OPTIM_STATE),
            "window_peak": engine.ledger.peak_bytes(Category.OFFLOAD_BUFFER),
            "owned": sum(g.owned_numel for g in engine.partition.groups)}


CASES = [(1, "fp32", 1.0, False, None), (2, "fp32", 0.5, False, None), (3, "fp32", 1.0, False, None),
         (2, "bf16", 1.0, False, None), (3, "bf16", 0.5, True, None), (1, "fp16", 1.0, False, None),
         (3, "fp16", 1.0, False, None), (1, "bf16", 1.0, False, "bf16"), (3, "bf16", 0.5, False, "bf16"),
         (2, "fp32", 1.0, False, "bf16"), (2, "fp32", 1.0, False, "fp8"), (3, "bf16", 0.5, False, "fp8")]
# AdamW's two moments: bytes an element (fp8: and 4 a block of 128), and the elements a sub-group holds
MOMENT_BYTES = {None: 8, "bf16": 4, "fp8": 2}
SUB_ELEMENTS = {None: SUB, "bf16": SUB, "fp8": 128}


def _job(root: str) -> list:
    rank, _ = rank_and_world()
    out = []
    for stage, dtype, ratio, shared, states in CASES:
        path = os.path.join(root, f"nvme-{stage}-{dtype}-{states}-{rank}")
        out.append((_run(_config(stage, dtype, None, shared=shared, states=states)),
                    _run(_config(stage, dtype, path, ratio, shared, states))))
    return out


def test_offloaded_states_train_identically(tmp_path):
    results = run_distributed(_job, 2, str(tmp_path))[0]
    for (stage, dtype, ratio, shared, states), (plain, offloaded) in zip(CASES, results):
        where = f"stage {stage} {dtype} ratio {ratio} shared {shared} states {states}"
        assert plain["losses"] == offloaded["losses"], where
        for name, value in plain["masters"].items():
            assert torch.equal(value, offloaded["masters"][name]), f"{where}: {name}"
        per_element, sub = MOMENT_BYTES[states], SUB_ELEMENTS[states]
        sub_bytes = per_element * sub + (2 * 4 if states == "fp8" else 0)  # (fp8: a scale a moment)
        if states != "fp8":  # (fp8's scales a block of each group: tests/optim/test_fp8_states.py)
            assert plain["resident"] == per_element * plain["owned"], where
        if ratio == 1.0:
            assert offloaded["resident"] == 0, where
        else:
            assert 0 < offloaded["resident"] < plain["resident"], where
        # at most buffer_count (3) sub-groups read or stepping plus 3 being written, over all groups (a
        # write drops its buffer before its future completes: tier_tensor._pwrite); bf16 moments move half the bytes
        assert 0 < offloaded["window_peak"] <= 2 * 3 * sub_bytes, where


def _resume(root: str, offload_first: bool, offload_second: bool, states: str | None) -> dict:
    rank, world = rank_and_world()
    path = lambda tag: os.path.join(root, f"{tag}-{rank}")  # noqa: E731
    straight = _run(_config(2, "fp32", path("a") if offload_first else None, states=states), steps=6)
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(2, "fp32", path("b") if offload_first else None, states=states))
    batches = make_batches(6 * world, 2)
    first = engine_train(engine, batches, 3, rank, world, 1)
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    torch.manual_seed(5)
    engine = zeroplus.initialize(ParityNet(), _config(2, "fp32", path("c") if offload_second else None,
                                                      states=states))
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    second = engine_train(engine, batches, 3, rank, world, 1, start=3)
    return {"straight": straight["losses"], "resumed": first + second,
            "masters": engine.consolidated_fp32_state(), "reference": straight["masters"]}


@pytest.mark.parametrize("offload_first,offload_second,states", [(True, True, None), (True, False, None),
                                                                 (True, True, "fp8")])
def test_checkpoints_keep_offloaded_states(tmp_path, offload_first, offload_second, states):
    result = run_distributed(_resume, 2, str(tmp_path), offload_first, offload_second, states)[0]
    assert result["straight"] == result["resumed"]
    for name, value in result["reference"].items():
        assert torch.equal(value, result["masters"][name]), name


def test_bad_offload_settings(tmp_path):
    cfg = _config(0, "fp32", str(tmp_path))
    with pytest.raises(zeroplus.ConfigError, match="offload_optimizer"):
        zeroplus.initialize(ParityNet(), cfg)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(zeroplus.ConfigError, match="offload_optimizer.nvme_path"):
        zeroplus.initialize(ParityNet(), dict(_config(1, "fp32", str(tmp_path)), zero_optimization={
            "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(blocker / "sub")}}))
    missing = tmp_path / "not-mounted"
    with pytest.raises(zeroplus.ConfigError, match="not-mounted' does not exist"):
        zeroplus.initialize(ParityNet(), dict(_config(1, "fp32", str(tmp_path)), zero_optimization={
            "stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": str(missing)}}))
    assert not missing.exists()


def test_a_last_chunk_of_one_element_keeps_its_states_per_element():
    """``TieredStates.full`` concatenates per-element states chunk by chunk; a last chunk of one element holds
    one-element tensors, which are per-element too (Adam's ``step`` is 0-dimensional). Taking them for scalars
    replaced the whole tensors by one element, and the load that followed gave fused Adam states shorter than
    its chunks: a segmentation fault (ZeRO-2, states in files, a 241-element group in chunks of 40)."""
    resident = 2  # both chunks resident: no tier is touched
    states = TieredStates(None, [(0, 3), (3, 4)], resident, Window(1), Ledger())
    states.put(0, {"step": torch.tensor(2.0), "exp_avg": torch.tensor([1.0, 2.0, 3.0])})
    states.put(1, {"step": torch.tensor(2.0), "exp_avg": torch.tensor([4.0])})
    full = states.full(4)
    assert torch.equal(full["exp_avg"], torch.tensor([1.0, 2.0, 3.0, 4.0])) and full["step"].dim() == 0
    states.load_full(full, 4)
    assert [tuple(states.get(k)["exp_avg"].shape) for k in range(2)] == [(3,), (1,)]
