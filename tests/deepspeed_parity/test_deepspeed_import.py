"""DeepSpeed ZeRO-1/2/3 checkpoints, made by DeepSpeed on CPU in the test, resume in zeroplus.

DeepSpeed trains 2 steps, saves, and trains 2 more; zeroplus (same JSON config) loads the checkpoint and
trains the same 2 steps: the stage-2 one after ``zeroplus convert --from-deepspeed``, the stage-3 one straight
from DeepSpeed's directory (``load_checkpoint`` imports it beside itself and removes the import after),
with ``latest`` and, from a copy without it, by its only tag.
The fp32 masters after loading equal DeepSpeed's own consolidation (``zero_to_fp32``) bitwise,
the step counter is kept, and the continued losses match DeepSpeed's: 1e-6 relative in fp32 (stage
3), 1e-2 in bf16 (stage 2, and stage 3 with DeepSpeed's ``bf16_optimizer_states`` and
``bf16_master_weights_and_grads``: the moments load as bf16 and the masters as bf16 weights). (Stage 1 writes the
same file format as stage 2.) ParityNet has a frozen
layer, a tied weight and root parameters, so the frozen fragments and aliases of the stage-3 files are exercised too.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.deepspeed_parity.ds_cpu import deepspeed_reference
from tests.dist_helper import run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train

pytest.importorskip("deepspeed")

# DeepSpeed's stage-1/2 format (flat partitions) and its stage-3 format; "bf16-low": bf16 with DeepSpeed's
# bf16_optimizer_states and bf16_master_weights_and_grads, which zeroplus serves (bf16 moments, bf16 masters)
CASES = [(2, "bf16"), (3, "fp32"), (3, "bf16-low")]


def _config(stage: int, dtype: str) -> dict:
    bf16: dict = {"enabled": dtype != "fp32"}
    if dtype == "bf16-low":
        bf16.update(bf16_optimizer_states=True, bf16_master_weights_and_grads=True)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": bf16,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000}


def _steps(engine, first: int, last: int) -> list[float]:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    return engine_train(engine, make_batches(4 * world, 2), last - first, rank, world, 1, start=first)


def _client_state() -> dict:
    """What a DeepSpeed-tutorial script saves beside the model: its data position (the same on every rank) and a
    value of its own rank's."""
    import torch.distributed as dist
    return {"seen": 12, "sampler": {"epoch": 1, "offset": 96}, "from_rank": dist.get_rank()}


def _deepspeed(root: str) -> list[list[float]]:
    deepspeed = deepspeed_reference()
    out = []
    for stage, dtype in CASES:
        torch.manual_seed(0)
        model = ParityNet()
        engine, *_ = deepspeed.initialize(model=model, config=_config(stage, dtype),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        _steps(engine, 0, 2)
        engine.save_checkpoint(os.path.join(root, f"ds-{stage}-{dtype}"), client_state=_client_state())
        out.append(_steps(engine, 2, 4))
    return out


def _zeroplus(root: str) -> list[dict]:
    import zeroplus
    out = []
    for stage, dtype in CASES:
        torch.manual_seed(1)
        cfg = dict(_config(stage, dtype), zeroplus={"log_level": "warning", "memory_estimate": False})
        engine = zeroplus.initialize(ParityNet(), cfg)
        source = os.path.join(root, f"ds-{stage}-{dtype}" if stage == 3 else f"zp-{stage}-{dtype}")
        path, client = engine.load_checkpoint(source)
        masters = engine.consolidated_fp32_state()
        moments = {str(v.dtype) for state in engine.optimizer.state.values() for k, v in state.items() if k != "step"}
        out.append({"steps": engine.global_steps, "masters": masters, "losses": _steps(engine, 2, 4), "path": path,
                    "moments": moments,
                    "client": client,
                    "left": sorted(f for f in os.listdir(source) if f.startswith(".zeroplus-import"))})
    engine = zeroplus.initialize(ParityNet(), dict(_config(3, "fp32"), zeroplus={"log_level": "error"}))
    path, _ = engine.load_checkpoint(os.path.join(root, "ds-3-no-latest"))  # its only tag, without latest
    out.append({"no_latest": path, "masters": engine.consolidated_fp32_state()})
    try:
        engine.load_checkpoint(os.path.join(root, "ds-3-broken"))
        out.append({"broken": None})
    except Exception as err:  # noqa: BLE001 - reported
        out.append({"broken": f"{type(err).__name__}: {err}"})
    return out


def test_deepspeed_checkpoint_resumes_in_zeroplus(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    root = str(tmp_path)
    ds_losses = run_distributed(_deepspeed, 2, root, timeout=600)[0]
    done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", "--from-deepspeed",
                           os.path.join(root, "ds-2-bf16"), os.path.join(root, "zp-2-bf16")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(os.path.join(root, "ds-3-fp32"), os.path.join(root, "ds-3-no-latest"))
    os.remove(os.path.join(root, "ds-3-no-latest", "latest"))
    shutil.copytree(os.path.join(root, "ds-3-fp32"), os.path.join(root, "ds-3-broken"))
    broken = os.path.join(root, "ds-3-broken", "global_step2", "zero_pp_rank_1_mp_rank_00_model_states.pt")
    os.remove(broken)  # a stage-3 checkpoint that lost one rank's model-states file
    ranks = run_distributed(_zeroplus, 2, root)
    results = ranks[0]
    for rank, got in enumerate(ranks):  # every rank names the missing file
        assert got[-1]["broken"] is not None and broken in got[-1]["broken"], got[-1]
    assert results[-2]["no_latest"] == os.path.join(root, "ds-3-no-latest", "global_step2")
    for rank, got in enumerate(ranks):  # the script's keys, nothing of DeepSpeed's: stage 3 from each rank's own
        for (stage, _), zp in zip(CASES, got):  # file, stages 1-2 from rank 0's (the only one), as DeepSpeed does
            want = {"seen": 12, "sampler": {"epoch": 1, "offset": 96}, "from_rank": rank if stage == 3 else 0}
            assert zp["client"] == want, f"rank {rank} stage {stage}: client state {zp['client']}"
    for (stage, dtype), ds, zp in zip(CASES, ds_losses, results):
        assert zp["steps"] == 2, (stage, dtype)
        assert zp["moments"] == {"torch.bfloat16" if dtype == "bf16-low" else "torch.float32"}, (dtype, zp["moments"])
        if stage == 3:  # loaded straight from DeepSpeed's directory, the import removed
            assert zp["path"] == os.path.join(root, f"ds-3-{dtype}", "global_step2") and zp["left"] == [], zp["path"]
        if stage == 3 and dtype == "fp32":
            for name, value in results[-2]["masters"].items():
                assert torch.equal(value, zp["masters"][name]), f"without latest: {name}"
        reference = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, f"ds-{stage}-{dtype}"))
        for name, value in zp["masters"].items():
            assert torch.equal(value, reference[name].float()), f"stage {stage} {dtype}: {name}"
        rtol = 1e-6 if dtype == "fp32" else 1e-2
        torch.testing.assert_close(torch.tensor(zp["losses"]), torch.tensor(ds), rtol=rtol, atol=0,
                                   msg=lambda m, s=stage, d=dtype: f"stage {s} {d}: continued losses\n{m}")
    done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", "--from-deepspeed",
                           os.path.join(root, "ds-3-broken"), os.path.join(root, "zp-broken")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and broken in done.stderr, done.stderr[-2000:]


def test_deepspeed_import_errors(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zeroplus.cli", "convert", "--from-deepspeed", str(tmp_path),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "latest" in done.stderr
