"""Misuse of the training loop is a clear error that changes nothing, and the model is never stale.

On 2 ranks at ZeRO stages 0-3 (fp32, ParityNet):
- ``engine.module.state_dict()``, and ``state_dict()`` of the model object passed to ``initialize``,
  read straight after ``step()`` equal the consolidated fp32 masters, bitwise, after every step (fails if
  the post-step all-gather of stages 1-2 is not waited for, or if a stage-3 state dict reads the freed
  gathered buffers);
- ``step()`` with no ``backward()`` since the last one raises and leaves masters, optimizer states and
  counters bitwise unchanged;
- a second ``backward()`` before ``step()`` raises; the engine then steps to exactly what an engine
  that never saw the second call reaches.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "error", "memory_estimate": False}}


def _state(engine) -> dict:
    out = {f"{g.name}/master": g.master_store.read(0, g.owned_numel).clone() for g in engine.partition.groups}
    for g in engine.partition.groups:
        out.update({f"{g.name}/{k}": v.clone() for k, v in engine.optimizer_state(g).items()
                    if isinstance(v, torch.Tensor)})
    out["counters"] = torch.tensor([engine.global_steps, engine.micro_steps])
    return out


def _misuse(stage: int) -> dict:
    rank, world = rank_and_world()
    batches = make_batches(8 * world, 2)
    torch.manual_seed(0)
    model = ParityNet()
    engine = zeroplus.initialize(model, _config(stage))
    stale = []
    for step in range(4):
        x, y = batches[step * world + rank]
        engine.backward(engine(x, y))
        engine.step()
        # straight after step(), through the engine (even steps) or the model object itself (odd steps)
        seen = {k: v.clone() for k, v in (engine.module if step % 2 == 0 else model).state_dict().items()}
        masters = engine.consolidated_fp32_state()
        stale += [f"step {step}: {n}" for n, v in masters.items() if not torch.equal(seen[n], v)]
    before = _state(engine)
    with pytest.raises(RuntimeError, match=r"step\(\) called without a backward\(\).*rank"):
        engine.step()
    unchanged_after_step = all(torch.equal(v, _state(engine)[k]) for k, v in before.items())
    x, y = batches[4 * world + rank]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match=r"backward\(\) called twice without step\(\)"):
        engine.backward(engine(x, y))
    engine.step()
    # the same 5 steps without the misuse
    torch.manual_seed(0)
    clean = zeroplus.initialize(ParityNet(), _config(stage))
    for step in range(5):
        x, y = batches[step * world + rank]
        clean.backward(clean(x, y))
        clean.step()
    a, b = _state(engine), _state(clean)
    return {"stale": stale, "unchanged_after_step": unchanged_after_step,
            "differs_from_clean": [k for k in a if not torch.equal(a[k], b[k])]}


def _all_stages() -> list[dict]:
    return [_misuse(stage) for stage in (0, 1, 2, 3)]


def test_misuse_is_refused_and_the_model_is_current():
    for rank, per_stage in enumerate(run_distributed(_all_stages, 2)):
        for stage, result in enumerate(per_stage):
            assert result["stale"] == [], f"stage {stage} rank {rank}: state_dict after step() stale"
            assert result["unchanged_after_step"], f"stage {stage} rank {rank}: a refused step() changed state"
            assert result["differs_from_clean"] == [], f"stage {stage} rank {rank}: {result['differs_from_clean']}"


def _attach_after_initialize(stage: int) -> list[str]:
    """A module and a parameter attached after initialize, each refused at the next forward; re-setting a module the
    model held is no change; after destroy() nothing watches the model any more."""
    rank, world = rank_and_world()
    x, y = make_batches(world, 2)[rank]
    out = []
    for attach in ("module", "parameter", "same module"):
        torch.manual_seed(0)
        model = ParityNet()
        engine = zeroplus.initialize(model, _config(stage))
        if attach == "module":
            model.blocks[0].extra = torch.nn.Linear(13, 13)
        elif attach == "parameter":
            model.scale = torch.nn.Parameter(torch.ones(1))
        else:
            model.blocks[0].up = model.blocks[0].up
        try:
            engine.backward(engine(x, y))
            engine.step()
            out.append("trained")
        except RuntimeError as err:
            out.append(str(err))
        engine.destroy()
    model.later = torch.nn.Linear(2, 2)  # after destroy(): the model is the user's again, nothing refuses
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_a_module_attached_after_initialize_is_refused_at_the_next_forward(stage):
    """Attached after initialize, a module's parameters would run in the forward without being averaged or stepped
    (DeepSpeed's users saw it train silently apart): every rank refuses at the next forward, naming it."""
    for rank, (module, parameter, same) in enumerate(run_distributed(_attach_after_initialize, 2, stage)):
        assert f"rank {rank}: the model was changed" in module, module
        assert "module blocks.0.extra (Linear: weight, bias)" in module, module
        assert "parameter <model>.scale (1,)" in parameter, parameter
        assert same == "trained", same


class _MixedDtypes(torch.nn.Module):
    """A gate the model keeps in bf16 beside fp32 layers, its input cast to the gate's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.gate = torch.nn.Linear(16, 16).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * self.gate(x.to(self.gate.weight.dtype)).float()).square().mean()


def test_a_unit_mixing_fp32_and_bf16_parameters_is_named_and_trains_as_the_model_cast():
    """One unit with fp32 and bf16 parameters (a hang or silent cast under DeepSpeed's ZeRO): the engine casts all
    to the compute dtype, as DeepSpeed's engine does, says so naming the parameters, and trains exactly as the plain
    model cast to that dtype (SGD, 3 steps, bitwise)."""
    import logging
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroplus").addHandler(handler)
    try:
        torch.manual_seed(0)
        engine = zeroplus.initialize(_MixedDtypes(), {
            "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": 2}, "zeroplus": {"memory_estimate": False}})
    finally:
        logging.getLogger("zeroplus").removeHandler(handler)
    assert any("come in 2 dtypes" in r and "'bfloat16': ['gate.weight', 'gate.bias']" in r for r in records), records
    torch.manual_seed(0)
    plain = _MixedDtypes().float()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g)
        engine.backward(engine(x))
        engine.step()
        plain(x).backward()
        opt.step()
        opt.zero_grad()
    got = engine.consolidated_fp32_state()
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p.detach()), name
    engine.destroy()
