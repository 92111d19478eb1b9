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
rewards to 5e-8. The three trainers run in turn in one launch per engine (``--jobs``).
"""
from __future__ import annotations

import json
import pathlib

import pytest

from tests.deepspeed_api.launch import hf_template, on_deepspeed, on_zeroplus
from tests.worker_shared import shared

pytest.importorskip("trl")


TRAINERS = ("dpo", "sft", "grpo")


def _runs(launch, root: pathlib.Path, name: str, config: dict) -> dict[str, dict]:
    """Every trainer in one launch of ``trl_train.py --jobs`` (one launch's imports for all): each one's result."""
    path = root / f"{name}.json"
    path.write_text(json.dumps(config))
    jobs = [["--trainer", trainer, "--deepspeed", str(path), "--output_dir", str(root / f"{name}-{trainer}"),
             "--out", str(root / f"{name}-{trainer}-result.json")] for trainer in TRAINERS]
    (root / f"{name}-jobs.json").write_text(json.dumps(jobs))
    launch("trl_train.py", ["--jobs", str(root / f"{name}-jobs.json")])
    return {trainer: json.loads((root / f"{name}-{trainer}-result.json").read_text()) for trainer in TRAINERS}


@pytest.fixture(scope="module")
def zeroplus_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One launch for the session, whichever worker asks first (``tests/worker_shared.py``)."""
    return shared(tmp_path_factory, "trl-zeroplus",
                  lambda root: _runs(on_zeroplus, root, "zeroplus", hf_template("hf_zero3_template", False)))


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    return shared(tmp_path_factory, "trl-deepspeed",
                  lambda root: _runs(on_deepspeed, root, "deepspeed", hf_template("hf_zero3_template", True)))


# ZeRO-3 only: there TRL partitions DPO's reference model too (at ZeRO-2 it stays a plain module; that case, 21 s,
# was dropped from the suite on 2026-11-25/26 to keep it under 15 minutes).
@pytest.mark.parametrize("trainer", TRAINERS)
def test_trl_trainer_runs_unchanged_and_matches_deepspeed(trainer, zeroplus_runs, request):
    ours = zeroplus_runs[trainer]
    assert ours["engine"] == "zeroplus.deepspeed_api.engine" and len(ours["loss"]) == 4
    if trainer == "dpo":
        assert ours["ref_engine"] == "zeroplus.deepspeed_api.engine.DeepSpeedEngine"
        assert ours["ref_stage"] == 3, "TRL keeps ZeRO-3 for the reference"
    theirs = request.getfixturevalue("deepspeed_runs")[trainer]
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert ours["reward"] == theirs["reward"], "GRPO: the same completions sampled, the same rewards"
    for key in ("rewards/chosen", "rewards/rejected"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
    if trainer == "dpo":
        assert ours["rewards/chosen"][-1] != 0.0, "the policy moved away from the reference"
