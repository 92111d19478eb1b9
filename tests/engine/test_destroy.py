"""``engine.destroy()`` gives the model back.

The issue's case, a tiny Hugging Face Llama at ZeRO-3 on 2 gloo ranks, then the memory techniques on one
rank: after ``destroy()`` no hook the engine added is left on the model (forward, forward-pre,
post-accumulate-grad, state-dict: counted on every module and parameter), a later call raises, and a second
``initialize`` on the same model trains exactly as a single build from the same values does (bitwise: the
same parameters, the same steps; before the fix it failed at its first backward with "parameter 2 reached
its gradient hook without a gradient", left by the first engine's hooks); with tiled MLPs and loss and fused
operators, every forward and setting the engine replaced is given back (``engine/model_patches.py``).
"""
from __future__ import annotations

import gc

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.hf_models import build

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def _hooks(model: torch.nn.Module) -> int:
    modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._state_dict_hooks)
                  + len(m._state_dict_pre_hooks) + len(m._backward_hooks) for m in model.modules())
    params = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    return modules + params


def _config(stage: int, **zeroplus_block) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, **zeroplus_block}}


def _train(engine, steps: int) -> list[float]:
    losses = []
    g = torch.Generator().manual_seed(engine.dp.rank)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _patched(model: torch.nn.Module) -> list[str]:
    """Modules with an instance forward or a tile size set on them, and the config's settings the engine changes."""
    names = [n for n, m in model.named_modules()
             if any(k in vars(m) for k in ("forward", "_zeroplus_tiled", "_zeroplus_loss_tiles",
                                           "_zeroplus_no_training_cache"))]
    return names + [f"attn {model.config._attn_implementation}"]


def _build_destroy_build(stage: int, zeroplus_block: dict) -> dict:
    torch.manual_seed(0)
    model = build("llama", "tiny")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = _hooks(model), _patched(model)
    first = zeroplus.initialize(model, _config(stage, **zeroplus_block))
    during = _hooks(model), _patched(model)
    first.destroy()
    first.destroy()  # a second call does nothing
    after = _hooks(model), _patched(model)
    with pytest.raises(RuntimeError, match="this engine was destroyed"):
        first(input_ids=torch.zeros(2, 4, dtype=torch.long))
    given_back = all(torch.equal(p.detach(), start[n]) for n, p in model.named_parameters())
    second = zeroplus.initialize(model, _config(stage, **zeroplus_block))
    again = _train(second, 3)
    second.destroy()
    torch.manual_seed(0)
    once = _train(zeroplus.initialize(build("llama", "tiny"), _config(stage, **zeroplus_block)), 3)
    return {"hooks": (before, during, after), "given_back": given_back, "again": again, "once": once,
            "trained_values": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _check(result: dict) -> None:
    (before, patched_before), (during, patched_during), (after, patched_after) = result["hooks"]
    assert during > before and after == before, result["hooks"]
    assert patched_after == patched_before, (patched_before, patched_during, patched_after)
    assert result["given_back"], "after destroy() the model does not hold the values it had"
    assert result["again"] == result["once"], (result["again"], result["once"])


def test_destroy_removes_every_hook_and_the_model_trains_again_at_zero3_on_two_ranks():
    results = run_distributed(_build_destroy_build, 2, 3, {})
    for r in results:
        _check(r)
    for name, value in results[0]["trained_values"].items():  # stage 3 gave every rank the whole trained model
        assert torch.equal(value, results[1]["trained_values"][name]), name


@pytest.mark.parametrize("stage,block", [(0, {}), (2, {}),
                                         (3, {"resize_recompute": {"enabled": True, "norms": True},
                                              "swap_attention": {"enabled": True}}),
                                         (2, {"tiled": {"mlp_tokens": 8, "loss_tokens": 8}, "fused_ops": True})],
                         ids=["stage0", "stage2", "stage3-techniques", "stage2-tiled-fused"])
def test_destroy_removes_every_hook_at_each_stage_and_with_the_memory_techniques(stage, block):
    _check(_build_destroy_build(stage, block))


@pytest.mark.parametrize("stage", [0, 2])
def test_a_technique_refused_after_others_were_installed_leaves_the_model_as_built(stage):
    """fused_ops replaces forwards and resize recompute hooks the model before swap attention is refused (it names
    a class the model lacks): the refusal leaves no hook and no replaced forward, and the model trains again as a
    fresh build does (at stage 3 a failed initialize leaves the released parameters without values, refused by a
    later initialize: ``_given_back_on_failure``)."""
    from zeroplus.config import ConfigError
    torch.manual_seed(0)
    model = build("llama", "tiny")
    before = _hooks(model), _patched(model)
    refused = {"fused_ops": True, "resize_recompute": {"enabled": True, "norms": True},
               "swap_attention": {"enabled": True, "modules": ["NoSuchAttention"]}}
    with pytest.raises(ConfigError, match="zeroplus.swap_attention"):
        zeroplus.initialize(model, _config(stage, **refused))
    assert (_hooks(model), _patched(model)) == before
    again = _train(zeroplus.initialize(model, _config(stage)), 2)
    torch.manual_seed(0)
    assert again == _train(zeroplus.initialize(build("llama", "tiny"), _config(stage)), 2)


def test_destroy_gives_back_a_context_parallel_hugging_face_models_forward_and_attention():
    """Context parallelism (2 ranks, Ulysses) replaces the model's forward (each rank keeps its slice) and its
    attention implementation; destroy() puts both back, and the model trains again as a fresh build does."""
    for r in run_distributed(_build_destroy_build, 2, 2, {"parallel": {"context": 2}}):
        (_, patched_before), (_, patched_during), _ = r["hooks"]
        assert "" in patched_during and patched_during != patched_before, patched_during  # it was replaced
        _check(r)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_dropped_without_destroy_takes_its_hooks_off_and_a_stage3_model_is_refused_after(stage):
    """Garbage collection removes the hooks too (no collective). At stage 2 the parameters keep their values and
    the model trains again as a single build does; at stage 3 their values were on the lost shards, and a second
    ``initialize`` refuses the model, naming a parameter, rather than training on empty tensors. A model whose
    engine is alive and not destroyed is refused the same way."""
    torch.manual_seed(0)
    model = build("llama", "tiny")
    before = _hooks(model)
    engine = zeroplus.initialize(model, _config(stage))
    with pytest.raises(ValueError, match=r"parameter 'model\.\w.*another engine.*still partitioned.*destroy\(\)"):
        zeroplus.initialize(model, _config(stage))
    _train(engine, 1)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    del engine
    gc.collect()
    assert _hooks(model) == before
    if stage == 3:
        with pytest.raises(ValueError, match="its engine is gone without destroy.*hold no values"):
            zeroplus.initialize(model, _config(stage))
        return
    assert all(torch.equal(p.detach(), values[n]) for n, p in model.named_parameters())
    again = _train(zeroplus.initialize(model, _config(stage)), 2)
    torch.manual_seed(0)
    reference = build("llama", "tiny")
    reference.load_state_dict(values)
    assert again == _train(zeroplus.initialize(reference, _config(stage)), 2)
