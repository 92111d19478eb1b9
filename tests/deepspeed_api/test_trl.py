"""TRL's trainers, unchanged, on zeroplus's DeepSpeed API and on DeepSpeed.

``scripts/trl_train.py`` trains a tiny Qwen2 4 steps on 2 gloo ranks with the Hugging Face ZeRO-3
template (DeepSpeed's without optimizer offload and with ``torch_adam``, which it needs on a
CPU; zeroplus's as they are). DPO's reference model is a second ``deepspeed.initialize`` without an
optimizer (refused before: "no optimizer") whose config, at ZeRO-3, carries TRL's bucket sizes as
dotted top-level keys (refused before as unknown keys); its fused LM head asks each parameter's
``ds_status`` (missing before). GRPO samples completions from the model gathered whole, pausing the
engine's stage-3 hooks through ``optimizer.parameter_offload`` as it does DeepSpeed's (an
AttributeError before). The logged losses, gradient norms and DPO's and GRPO's rewards must equal
DeepSpeed's: losses and norms within 1e-5 relative, rewards (beta times a difference of two
log-probabilities near -25) within 1e-6 absolute. Measured: gradient norms to 1e-8 relative,
rewards to 5e-8.
"""
from __future__ import annotations

import json
import pathlib

import pytest

from tests.deepspeed_api.launch import hf_template, on_deepspeed, on_zeroplus

pytest.importorskip("trl")




def _run(launch, tmp_path: pathlib.Path, name: str, trainer: str, config: dict) -> dict:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    out = tmp_path / f"{name}-result.json"
    launch("trl_train.py", ["--trainer", trainer, "--deepspeed", str(path), "--output_dir", str(tmp_path / name),
                            "--out", str(out)])
    return json.loads(out.read_text())


# ZeRO-3 only: there TRL partitions DPO's reference model too (at ZeRO-2 it stays a plain module; that case, 21 s,
# was dropped from the suite on 2026-11-25/26 to keep it under 15 minutes).
@pytest.mark.parametrize("trainer,stage", [("dpo", 3), ("sft", 3), ("grpo", 3)])
def test_trl_trainer_runs_unchanged_and_matches_deepspeed(tmp_path, trainer, stage):
    ours = _run(on_zeroplus, tmp_path, "zeroplus", trainer, hf_template(f"hf_zero{stage}_template", False))
    assert ours["engine"] == "zeroplus.deepspeed_api.engine" and len(ours["loss"]) == 4
    if trainer == "dpo":
        assert ours["ref_engine"] == "zeroplus.deepspeed_api.engine.DeepSpeedEngine"
        assert ours["ref_stage"] == (3 if stage == 3 else 0), "TRL keeps ZeRO-3 for the reference, else stage 0"
    pytest.importorskip("deepspeed")
    theirs = _run(on_deepspeed, tmp_path, "deepspeed", trainer, hf_template(f"hf_zero{stage}_template", True))
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert ours["reward"] == theirs["reward"], "GRPO: the same completions sampled, the same rewards"
    for key in ("rewards/chosen", "rewards/rejected"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    if trainer == "dpo":
        assert ours["rewards/chosen"][-1] != 0.0, "the policy moved away from the reference"
