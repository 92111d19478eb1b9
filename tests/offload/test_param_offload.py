"""Parameter offload (``zero_optimization.offload_param``, stage 3) changes no number.

On 2 ranks at stage 3, with the master (parameter) shards in files: losses and fp32 masters
bitwise equal to the run without offload, in fp32, bf16 and fp16, with shared-storage master weights,
and together with optimizer-state offload; the ledger holds no ``master`` bytes (it records them
as kept off the device by ``offload_param``) and the shards are files in the tier's directory
while training. A checkpoint saved with offloaded shards resumes bit for bit, with or without
offload. Offload at stage 2, an unusable path and a disk too small for the shards are errors at
initialisation naming the key (the last one made real with a file-size limit on the process).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.ledger import Category
from zeroplus.offload.disk_space import check_free_space


def _config(dtype: str, param_path: str | None, opt_path: str | None = None, shared: bool = False,
            stage: int = 3) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if param_path is not None:
        zero["offload_param"] = {"device": "nvme", "nvme_path": param_path}
    if opt_path is not None:
        zero.update(sub_group_size=40, offload_optimizer={"device": "nvme", "nvme_path": opt_path, "buffer_count": 3})
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": dtype == "bf16"},
            "fp16": {"enabled": dtype == "fp16", "initial_scale_power": 8},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "zero_optimization": zero,
            # small step chunks: the master is read and rewritten in many ranges
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "shared_master_weights": shared,
                         "master_step_chunk": 64}}


CASES = [("fp32", False, False), ("bf16", False, False), ("bf16", True, False), ("fp32", False, True),
         ("bf16", True, True), ("fp16", False, True)]


def _run(cfg: dict, steps: int = 4) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), cfg)
    files = glob.glob(os.path.join(cfg["zero_optimization"].get("offload_param", {}).get("nvme_path", "/nonexistent"),
                                   f"zeroplus-swap-{os.getpid()}-param", "kept-*.bin"))
    losses = engine_train(engine, make_batches(steps * world, 2), steps, rank, world, 1)
    return {"losses": losses, "masters": engine.consolidated_fp32_state(), "files": len(files),
            "master_bytes": engine.ledger.live_bytes(Category.MASTER),
            "kept_off": engine.ledger.saved_bytes("offload_param", Category.MASTER),
            "owned": sum(g.owned_numel for g in engine.partition.groups),
            "groups": len(engine.partition.groups)}


def _directory(path: str) -> str:
    os.makedirs(path, exist_ok=True)  # zeroplus does not create offload directories
    return path


def _job(root: str) -> list:
    rank, _ = rank_and_world()
    out = []
    for i, (dtype, shared, with_optimizer) in enumerate(CASES):
        plain = _run(_config(dtype, None, shared=shared))
        opt_path = _directory(os.path.join(root, f"opt-{i}-{rank}")) if with_optimizer else None
        out.append((plain, _run(_config(dtype, _directory(os.path.join(root, f"param-{i}-{rank}")), opt_path,
                                        shared))))
    return out


def test_offloaded_parameters_train_identically(tmp_path):
    results = run_distributed(_job, 2, str(tmp_path))[0]
    for (dtype, shared, with_optimizer), (plain, offloaded) in zip(CASES, results):
        where = f"{dtype} shared {shared} optimizer offload {with_optimizer}"
        assert plain["losses"] == offloaded["losses"], where
        for name, value in plain["masters"].items():
            assert torch.equal(value, offloaded["masters"][name]), f"{where}: {name}"
        assert plain["master_bytes"] == 4 * plain["owned"], where  # fp32 master, or bf16 high + int16 low
        assert offloaded["master_bytes"] == 0, where
        assert offloaded["kept_off"] == 4 * offloaded["owned"], where
        assert offloaded["files"] == offloaded["groups"] * (2 if shared else 1), where


def _resume(root: str, offload_first: bool, offload_second: bool) -> dict:
    rank, world = rank_and_world()
    path = lambda tag, on: _directory(os.path.join(root, f"{tag}-{rank}")) if on else None  # noqa: E731
    straight = _run(_config("bf16", None, shared=True), steps=6)
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config("bf16", path("a", offload_first), shared=True))
    batches = make_batches(6 * world, 2)
    first = engine_train(engine, batches, 3, rank, world, 1)
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    torch.manual_seed(5)
    engine = zeroplus.initialize(ParityNet(), _config("bf16", path("b", offload_second), shared=True))
    engine.load_checkpoint(os.path.join(root, "ckpt"))
    second = engine_train(engine, batches, 3, rank, world, 1, start=3)
    return {"straight": straight["losses"], "resumed": first + second,
            "masters": engine.consolidated_fp32_state(), "reference": straight["masters"]}


@pytest.mark.parametrize("offload_first,offload_second", [(True, True), (False, True), (True, False)])
def test_checkpoints_keep_offloaded_parameters(tmp_path, offload_first, offload_second):
    result = run_distributed(_resume, 2, str(tmp_path), offload_first, offload_second)[0]
    assert result["straight"] == result["resumed"]
    for name, value in result["reference"].items():
        assert torch.equal(value, result["masters"][name]), name


def test_bad_parameter_offload_settings(tmp_path):
    with pytest.raises(zeroplus.ConfigError, match=r"offload_param' needs ZeRO stage 3 \(stage is 2\)"):
        zeroplus.initialize(ParityNet(), _config("fp32", str(tmp_path), stage=2))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(zeroplus.ConfigError, match="offload_param.nvme_path.*rank 0"):
        zeroplus.initialize(ParityNet(), _config("fp32", str(blocker / "sub")))
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OSError, match="GiB free, and this rank needs"):
        check_free_space(str(tmp_path), free + 2**30)


_FULL_DISK = """
import resource, signal, sys
import zeroplus
from tests.models import ParityNet
from tests.offload.test_param_offload import _config
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))   # files may not grow past 256 bytes
try:
    zeroplus.initialize(ParityNet(), _config("fp32", sys.argv[1]))
except zeroplus.ConfigError as err:
    print("ERROR", err)
"""


def test_no_room_for_the_shards_is_an_error_at_initialisation(tmp_path):
    """ParityNet's groups are larger than 256 bytes: reserving their files fails before step 0."""
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert "ERROR config key 'zero_optimization.offload_param.nvme_path'" in proc.stdout, proc.stderr[-2000:]
    assert "cannot reserve" in proc.stdout
    assert not glob.glob(str(tmp_path / "zeroplus-swap-*" / "kept-*.bin"))
