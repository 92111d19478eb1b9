"""DeepSpeed's ZeRO++ tutorial config runs unchanged under ``zeroplus run --deepspeed-api`` over two nodes.

The tutorial's ``zero_optimization`` block (stage 3, ``reduce_bucket_size`` 1e7, ``reduce_scatter`` false,
``zero_quantized_weights``, ``zero_quantized_gradients``, ``contiguous_gradients``, ``overlap_comm``) with
``zero_hpz_partition_size`` at the ranks of a node, as the tutorial says to set it (16 there, 2 here), and
``stage3_param_persistence_threshold`` 0 so the tutorial script's small model is gathered at all; the script of
``test_tutorial_script`` (the same file, unchanged: ``zero.Init``, accumulation 2, clipping, AdamW, WarmupLR, a
checkpoint saved and resumed) on 2 simulated nodes of 2 ranks (two launchers with ``--nnodes 2``, each node's ranks
reading ``LOCAL_WORLD_SIZE`` 2). Against the same launch without the ZeRO++ keys: the losses within 1% relative (int8
weights and gradients: measured below 0.1%) and not equal (the quantization ran); the resumed engine's losses equal the
uninterrupted ones bit for bit (checkpoints save and load under this layout); initialize says the layout it made
(hpZ over 2 ranks, qgZ's two levels over the nodes, qwZ, qgZ).

DeepSpeed 0.19.8 itself does not run this block on CPU: zero.Init builds its int8 quantizer, which has no CPU
implementation ("This op had not been implemented on CPU backend"), and its stage 3 asserts that qgZ needs
``reduce_scatter`` true, where zeroplus lets qgZ's all-to-all reduce at stage 3 whatever the key says, as DeepSpeed's
stage 3 did when the tutorial was written (its gradients are always partitioned).
"""
from __future__ import annotations

import json

import pytest

from tests.deepspeed_api.launch import on_zeroplus_nodes

TUTORIAL = {"stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": False,
            "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
            "contiguous_gradients": True, "overlap_comm": True}


def _config(zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 0.3,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 3}},
            "zero_optimization": zero | {"stage3_param_persistence_threshold": 0},
            "steps_per_print": 1000}


def _run(tmp_path, name: str, zero: dict) -> tuple[dict, str]:
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(_config(zero)))
    out = tmp_path / f"{name}-losses.json"
    done = on_zeroplus_nodes("tutorial.py", ["--deepspeed", "--deepspeed_config", str(config), "--out", str(out),
                                             "--ckpt", str(tmp_path / f"{name}-ckpt")])
    return json.loads(out.read_text()), done[0].stdout + done[0].stderr


def test_the_zeropp_tutorial_config_trains_over_two_nodes_and_resumes(tmp_path):
    zeropp, said = _run(tmp_path, "zeropp", TUTORIAL)
    plain, _ = _run(tmp_path, "plain", {"stage": 3})
    assert zeropp["engine"] == "zeroplus.deepspeed_api.engine" and zeropp["stage"] == 3
    assert "over nodes of 2 ranks: hpZ keeps a secondary copy over 2 ranks; two-level collectives over nodes of 2 " \
           "ranks; qwZ: int8 weight gathers; qgZ: int8 gradient reductions" in said, said[-4000:]
    assert zeropp["resumed"] == zeropp["continued"], "resumed from the checkpoint, the losses must not change"
    for key in ("losses", "continued"):
        assert zeropp[key] != plain[key], key
        assert zeropp[key] == pytest.approx(plain[key], rel=1e-2), key
