"""zeroplus's DeepSpeed API in one process: its shape, its refusals, and how ``import deepspeed`` reaches it.

In process (``import zeroplus.deepspeed_api as deepspeed``, one rank): ``initialize`` returns
DeepSpeed's 4-tuple with a sampler-backed loader of micro-batches; ``backward(scale_wrt_gas=False)``
leaves the loss undivided; the accumulation boundary can be set from outside (Accelerate's way:
backward, backward, step) and the result equals the counted one; the consolidated 16-bit state dict
is the model's; DeepSpeed names zeroplus does not serve raise ``NotImplementedError`` naming them
(while ``hasattr`` answers False). Through ``python -m zeroplus.deepspeed_api``: ``import deepspeed``
is zeroplus, Transformers' and Accelerate's availability and version checks pass, an unserved
submodule is a ``ModuleNotFoundError`` saying so, and a process that imported the real DeepSpeed first
is refused.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch

import zeroplus.deepspeed_api as deepspeed
from tests.deepspeed_api.launch import ROOT, _env
from tests.models import ParityNet, make_batches
from zeroplus.deepspeed_api.shim import environment_with_shim

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2},
          "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _engine(config: dict = CONFIG, **kwargs):
    torch.manual_seed(0)
    model = ParityNet()
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_initialize_returns_deepspeeds_four_tuple_and_a_loader():
    rows = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    engine, optimizer, loader, scheduler = _engine(training_data=rows)
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and isinstance(engine, torch.nn.Module)
    assert engine.config is not CONFIG and engine.config["zero_optimization"] == {"stage": 2}
    assert optimizer is engine.optimizer and optimizer.param_groups[0]["lr"] == 1e-2 and not optimizer.overflow
    assert scheduler is None and engine.zero_optimization_stage() == 2 and engine.train_batch_size() == 4
    assert next(iter(loader)).shape == (2, 4)
    assert sorted(engine.state_dict()) == sorted(f"module.{n}" for n in engine.module.state_dict())
    with pytest.raises(ValueError, match="both as config= and as args.deepspeed_config"):
        _engine(args=type("Args", (), {"deepspeed_config": "ds.json"})())


def test_boundary_set_from_outside_equals_the_counted_one():
    batches = make_batches(4, 2)
    counted, *_ = _engine()
    told, *_ = _engine()
    for i, (x, y) in enumerate(batches):
        counted.backward(counted(x, y))
        counted.step()
        told.set_gradient_accumulation_boundary(i % 2 == 1)  # Accelerate: no step() off the boundary
        told.backward(told(x, y))
        if i % 2 == 1:
            told.step()
    assert counted.global_steps == told.global_steps == 2
    for name, value in _weights(counted).items():
        assert torch.equal(value, _weights(told)[name]), name
    told.set_gradient_accumulation_boundary(True)
    told.backward(told(*batches[0]))
    with pytest.raises(RuntimeError, match="twice without step"):  # a reducing backward already ran
        told.backward(told(*batches[0]))


def _gradient(group) -> list[torch.Tensor]:
    """Each parameter's gradient as the group holds it (kept at one rank, else in its flat or reduced buffer)."""
    return [group.gradient.of(i) for i in range(len(group.params))]


def test_backward_without_accumulation_scaling_and_the_16bit_state_dict():
    x, y = make_batches(1, 2)[0]
    scaled, *_ = _engine()
    unscaled, *_ = _engine()
    scaled.backward(scaled(x, y) * 2)  # divided by 2 accumulation steps
    unscaled.backward(unscaled(x, y), scale_wrt_gas=False)
    scaled.step()
    unscaled.step()  # not the boundary: nothing stepped, gradients kept
    for a, b in zip(scaled.engine.partition.groups, unscaled.engine.partition.groups):
        assert all(torch.equal(u, v) for u, v in zip(_gradient(a), _gradient(b), strict=True))
    state = scaled._zero3_consolidated_16bit_state_dict()
    assert set(state) == set(scaled.module.state_dict())
    assert all(torch.equal(state[n], t) for n, t in scaled.module.state_dict().items())


def test_what_is_not_served_is_named():
    engine, optimizer, *_ = _engine()
    with pytest.raises(NotImplementedError, match="DeepSpeedEngine.get_sequence_parallel_group is part of DeepSpeed's "
                                                  "API that zeroplus does not support yet"):
        engine.get_sequence_parallel_group()
    assert not hasattr(engine, "get_sequence_parallel_group") and not hasattr(deepspeed, "init_inference")
    with pytest.raises(NotImplementedError, match="deepspeed.init_inference"):
        deepspeed.init_inference
    with pytest.raises(NotImplementedError, match=r"engine.step\(\)"):
        optimizer.step()
    with pytest.raises(NotImplementedError, match="mpu"):
        _engine(mpu=object())
    with pytest.raises(NotImplementedError, match="zero_quantized_weights"):
        deepspeed.zero.Init(zero_quantized_weights=True)
    with pytest.raises(NotImplementedError, match="bias_correction=False"):
        deepspeed.ops.adam.DeepSpeedCPUAdam(ParityNet().parameters(), bias_correction=False)


def test_offload_states_takes_deepspeeds_enums_and_round_trips():
    """RL frameworks' call: ``offload_states(include=[OffloadStateTypeEnum...], device=OffloadDeviceEnum.cpu)``,
    then ``reload_states()``; training goes on exactly as without (``tests/engine/test_state_offload.py``
    has the per-stage checks)."""
    from zeroplus.deepspeed_api.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    batches = make_batches(4, 2)
    ours, *_ = _engine()
    plain, *_ = _engine()
    for i, (x, y) in enumerate(batches):
        for engine in (ours, plain):
            engine.backward(engine(x, y))
            engine.step()
        if i == 1:
            ours.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                                device=OffloadDeviceEnum.cpu, non_blocking=True)
            with pytest.raises(RuntimeError, match=r"reload_states\(\) first"):
                ours(x, y)
            ours.reload_states()
    assert all(torch.equal(a, b) for a, b in zip(_weights(ours).values(), _weights(plain).values()))
    with pytest.raises(ValueError, match="the states go to host memory"):
        ours.offload_states(device=OffloadDeviceEnum.nvme)


PROBE = """
import importlib.metadata, deepspeed
from transformers.integrations.deepspeed import is_deepspeed_available
from accelerate.utils import is_deepspeed_available as accelerate_has_it
from accelerate.utils.versions import compare_versions
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
import deepspeed.runtime.lr_schedules
assert deepspeed.__name__ == "zeroplus.deepspeed_api", deepspeed
assert importlib.metadata.version("deepspeed") == deepspeed.__version__ == "0.19.8+zeroplus"
assert is_deepspeed_available() and accelerate_has_it() and compare_versions("deepspeed", ">=", "0.16.4")
assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
assert partition_parameters.Init is deepspeed.zero.Init
try:
    import deepspeed.launcher.runner
except ModuleNotFoundError as err:
    print("refused:", err)
"""


@pytest.mark.parametrize("launch", ["module", "shim in a moved cache"])
def test_import_deepspeed_is_zeroplus_under_the_launch_option(tmp_path, monkeypatch, launch):
    """``module``: ``python -m zeroplus.deepspeed_api script``. ``shim in a moved cache``: the script run as
    ``zeroplus run --deepspeed-api`` runs each rank, the shim first on ``PYTHONPATH``, written where
    ``ZEROPLUS_CACHE_DIR`` says, a folder whose path does not say zeroplus: the shim is still told from the real
    DeepSpeed by a mark it sets, not by its path."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    with tempfile.TemporaryDirectory(prefix="cache-") as moved:
        if launch == "module":
            cmd, env = [sys.executable, "-m", "zeroplus.deepspeed_api", str(script)], _env()
        else:
            monkeypatch.setenv("ZEROPLUS_CACHE_DIR", moved)
            cmd, env = [sys.executable, str(script)], environment_with_shim(_env())
            assert env["PYTHONPATH"].startswith(moved), env["PYTHONPATH"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "refused: No module named 'deepspeed.launcher'" in done.stdout and "does not serve" in done.stdout
    assert done.stderr.count("serves DeepSpeed's API in this process") == 1, done.stderr[-2000:]


def test_a_process_that_imported_the_real_deepspeed_is_refused():
    pytest.importorskip("deepspeed")
    code = ("import deepspeed\nfrom zeroplus.deepspeed_api.alias import install\n"
            "try:\n    install()\nexcept RuntimeError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert "the real DeepSpeed" in done.stdout and "was imported in this process before" in done.stdout, done


def test_client_optimizer_factory_and_schedule_callable():
    """The Trainer without optimizer/scheduler blocks passes its own AdamW and a callable that builds its
    schedule over the optimizer DeepSpeed hands it; DeepSpeed also takes an optimizer factory."""
    config = {k: v for k, v in CONFIG.items() if k != "optimizer"}
    schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))  # noqa: E731
    engine, optimizer, _, scheduler = _engine(config, optimizer=lambda params: torch.optim.AdamW(params, lr=0.1),
                                              lr_scheduler=schedule)
    assert isinstance(engine.basic_optimizer, torch.optim.AdamW) and scheduler.optimizer is engine.basic_optimizer
    for x, y in make_batches(4, 2):
        engine.backward(engine(x, y))
        engine.step()
    assert engine.get_lr() == [0.1 / 3] and optimizer.param_groups[0]["lr"] == 0.1 / 3  # 2 steps taken
