"""A script in DeepSpeed's tutorial shape (``scripts/tutorial.py``) runs unchanged on zeroplus.

The same file and JSON (ZeRO-3 with ``zero.Init``, gradient accumulation 2, binding clipping,
AdamW, WarmupLR) on 2 ranks: ``zeroplus run --deepspeed-api`` and torchrun on the real DeepSpeed
0.19.8. Losses equal within 1e-5 relative (fp32; the same math summed in another order: measured
below 1e-6). On zeroplus, the resumed engine's losses equal the uninterrupted ones bit for bit, and the
script saw zeroplus's engine, optimizer and schedule.
"""
from __future__ import annotations

import json

import pytest

from tests.deepspeed_api.launch import on_deepspeed, on_zeroplus

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                       "warmup_num_steps": 3}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "steps_per_print": 1000}


def _run(launch, tmp_path, name: str) -> dict:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(CONFIG))
    out = tmp_path / f"{name}.json"
    launch("tutorial.py", ["--deepspeed", "--deepspeed_config", str(config), "--out", str(out),
                           "--ckpt", str(tmp_path / f"{name}-ckpt")])
    return json.loads(out.read_text())


def test_tutorial_script_runs_unchanged_and_matches_deepspeed(tmp_path):
    ours = _run(on_zeroplus, tmp_path, "zeroplus")
    assert ours["engine"] == "zeroplus.deepspeed_api.engine" and ours["stage"] == 3
    assert ours["optimizer"] == "DeepSpeedZeroOptimizer" and ours["scheduler"] == "WarmupLR"
    assert ours["resumed"] == ours["continued"], "resumed from the checkpoint, the losses must not change"
    pytest.importorskip("deepspeed")
    theirs = _run(on_deepspeed, tmp_path, "deepspeed")
    assert theirs["engine"].startswith("deepspeed.")
    for key in ("losses", "continued", "resumed", "lr"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
