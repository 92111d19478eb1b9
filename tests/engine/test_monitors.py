"""Monitors: ``"tensorboard"``, ``"csv_monitor"``, ``"wandb"`` (offline), and a missing package.

Two gloo ranks train 4 steps at ZeRO-2 with TensorBoard, CSV and Weights & Biases (offline) on, and the
breakdown and the FLOPs profiler too, ``steps_per_print`` 2. Read back with TensorBoard's own reader: rank 0's
``Train/Samples/train_loss`` is the loss it gave ``backward()`` at each step, at DeepSpeed's x-axis (samples:
4, 8, 12, 16), ``Train/Samples/lr`` and ``grad_norm`` every step; the breakdown's
``Train/Samples/elapsed_time_ms_*``, ``samples_per_second``, ``tokens_per_second``, ``mfu`` and the memory per
category every 2 steps. The CSV files hold the same numbers in DeepSpeed's layout; the W&B run's summary the
last ones. Only rank 0 wrote (one event file). A monitor whose package is missing is a ``ConfigError`` naming
the key and the package, before anything is built.
"""
from __future__ import annotations

import csv
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches


def _config(root: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2}, "steps_per_print": 2, "wall_clock_breakdown": True,
            "flops_profiler": {"enabled": True, "profile_step": 1},
            "tensorboard": {"enabled": True, "output_path": os.path.join(root, "tb"), "job_name": "run"},
            "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "run"},
            "wandb": {"enabled": True, "project": "zeroplus-test"},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "peak_tflops": 1.0}}


def _job(root: str) -> dict:
    rank, world = rank_and_world()
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=os.path.join(root, "wandb"), WANDB_SILENT="true")
    os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(root))
    batches = make_batches(8 * world, 2)
    losses = []
    for k in range(4):
        x, y = batches[k * world + rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    summary = None
    if rank == 0:
        import wandb
        summary = {k: wandb.run.summary[k] for k in wandb.run.summary.keys() if not k.startswith("_")}
    engine.destroy()
    return {"losses": losses, "summary": summary}


def test_tensorboard_csv_and_wandb_receive_deepspeeds_events_and_ours_from_rank_0(tmp_path):
    root = str(tmp_path)
    ranks = run_distributed(_job, 2, root)
    run = os.path.join(root, "tb", "run")
    assert len([f for f in os.listdir(run) if f.startswith("events.out")]) == 1, os.listdir(run)
    events = EventAccumulator(run)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == [4, 8, 12, 16]
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx(ranks[0]["losses"], rel=1e-6)
    assert [s for s, _ in scalars["Train/Samples/lr"]] == [4, 8, 12, 16]
    assert len(scalars["Train/Samples/grad_norm"]) == 4
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        assert [s for s, _ in scalars[f"Train/Samples/elapsed_time_ms_{name}"]] == [8, 16], name
    for name in ("samples_per_second", "tokens_per_second", "mfu", "tflops"):
        assert [s for s, _ in scalars[f"Train/Samples/{name}"]] == [8, 16] and scalars[f"Train/Samples/{name}"][
            -1][1] > 0, name
    assert scalars["Memory/measured_peak_bytes/optim_state"][-1][1] > 0
    with open(os.path.join(root, "csv", "run", "Train_Samples_train_loss.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [4, 8, 12, 16]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(ranks[0]["losses"], rel=1e-6)
    summary = ranks[0]["summary"]
    assert summary["Train/Samples/train_loss"] == pytest.approx(ranks[0]["losses"][-1], rel=1e-6), summary
    assert os.listdir(os.path.join(root, "wandb", "wandb"))


def test_a_monitor_without_its_package_is_a_config_error_naming_both():
    try:
        import comet_ml  # noqa: F401
        pytest.skip("comet_ml is installed here")
    except ImportError:
        pass
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "comet": {"enabled": True}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    with pytest.raises(zeroplus.ConfigError, match=r"'comet.enabled'.*'comet_ml' is not installed.*comet-ml"):
        zeroplus.initialize(ParityNet(), cfg)


def test_comet_offline_receives_the_events_where_comet_ml_is_installed(tmp_path, monkeypatch):
    """Comet (``comet_ml``, not in the ``monitors`` extra): an offline experiment's archive holds rank 0's
    ``Train/Samples/train_loss`` at its sample count."""
    pytest.importorskip("comet_ml")
    import json
    import zipfile
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "comet": {"enabled": True, "online": False, "project": "zeroplus-test"},
           "zeroplus": {"log_level": "warning", "memory_estimate": False}}
    engine = zeroplus.initialize(ParityNet(), cfg)
    x, y = make_batches(1, 2)[0]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    engine.destroy()
    archive = [f for f in os.listdir(tmp_path) if f.endswith(".zip")]
    assert archive, os.listdir(tmp_path)
    with zipfile.ZipFile(tmp_path / archive[0]) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
    metrics = {m["payload"]["metric"]["metricName"]: m["payload"]["metric"] for m in messages
               if m.get("type") == "metric_msg"}
    assert metrics["Train/Samples/train_loss"]["step"] == 2
    assert metrics["Train/Samples/train_loss"]["metricValue"] == pytest.approx(float(loss.detach()), rel=1e-6)
