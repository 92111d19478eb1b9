"""Adam/AdamW moments stored in bf16 or fp16 (``zeroplus/optim/stored_states.py``): ``zeroplus.optimizer_states``
and DeepSpeed's ``bf16.bf16_optimizer_states``.

- The optimizer against a reference in one process: torch's fused AdamW whose moments are rounded to the stored
  dtype after every step (rounding to nearest) gives the same parameters bit for bit; fp32 stored moments are
  torch's fused AdamW bit for bit; stochastic rounding is unbiased (64 roundings of a value average within about
  2e-4 of it, where rounding to nearest is 2e-3 away on average, and the errors' mean over 65536 values is under
  1e-5), leaves non-finite values as rounding to nearest does, and rounds a value the same way whatever tensor holds
  it (a hash of its bits and the step).
- The engine at one rank, every stage, bf16 moments rounded to nearest and stochastically: bit for bit the plain
  module with the same optimizer (``StoredStatesAdamW(fused=True)``), the moments stored in bf16, the ledger's
  ``optim_state`` 4 bytes per trained element (8 in fp32), and the memory estimate predicting the category exactly.
- At 2 ranks (stages 1-3) and 4 (stage 3): the plain module's parameters within 2e-4 of each tensor's largest after
  5 steps (the gradients reach the moments summed in another order, and a moment's last fp32 bit can move its bf16
  rounding, a change of 2^-8 of it, about 1e-4 of a weight at lr 1e-2; measured 2.1e-7 at 2 ranks and 1.9e-7 at 4,
  2026-12-04: no rounding moved), and the ledger's ``optim_state`` 4 bytes per owned element on every rank.
- A client's torch AdamW at 2 ranks (stages 1 and 3): made the stored-states AdamW in place (the same object, its
  scheduler bound before ``initialize`` still in force), bit for bit the config block's run.
- Refused, naming the key and the rank: a client optimizer other than Adam/AdamW or with amsgrad, an optimizer block
  other than Adam/AdamW, stochastic rounding of fp16 moments. (Offloaded stored states:
  tests/offload/test_optimizer_offload.py.)
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, train_steps
from zeroplus.config import ConfigError
from zeroplus.kernels.stochastic_round import store
from zeroplus.ledger import Category
from zeroplus.optim.stored_states import StoredStatesAdamW

LR = 1e-2


def _config(stage: int, states: dict | None = None, **more) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage},
           "zeroplus": {"log_level": "warning", "memory_estimate": False,
                        "optimizer_states": states if states is not None else {"exp_avg": "bf16",
                                                                                "exp_avg_sq": "bf16"}}}
    for key, value in more.items():
        cfg[key] = value
    return cfg


def _train_pair(model: torch.nn.Module, a: torch.optim.Optimizer, b_model: torch.nn.Module,
                b: torch.optim.Optimizer, steps: int, after=None) -> None:
    for _ in range(steps):
        x = torch.randn(8, 300)
        for mod, opt in ((model, a), (b_model, b)):
            opt.zero_grad()
            mod(x).square().mean().backward()
            opt.step()
        if after is not None:
            after()


@pytest.mark.fast
def test_the_optimizer_equals_fused_adamw_rounding_its_moments_after_each_step():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(), torch.nn.Linear(200, 37))
    ours, ref = copy.deepcopy(net), copy.deepcopy(net)
    opt = StoredStatesAdamW(ours.parameters(), lr=LR, weight_decay=0.1, fused=True, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1, fused=True)

    def round_reference() -> None:
        for state in torch_opt.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].bfloat16())

    _train_pair(ours, opt, ref, torch_opt, 6, round_reference)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    # fp32 moments: torch's fused AdamW itself
    ours, ref = copy.deepcopy(net), copy.deepcopy(net)
    _train_pair(ours, StoredStatesAdamW(ours.parameters(), lr=LR, fused=True), ref,
                torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), 3)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))


@pytest.mark.fast
def test_stochastic_rounding_is_unbiased_and_the_same_wherever_a_value_is():
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0)) + 1.0
    out = torch.empty_like(x, dtype=torch.bfloat16)
    total = torch.zeros_like(x, dtype=torch.float64)
    for step in range(64):
        store(out, x, "stochastic", torch.tensor(float(step)))
        total += out.double()
        assert ((out.double() - x.double()).abs() < 2 ** -7).all()  # one of the two neighbours
    bias = total / 64 - x.double()  # each element's mean rounding error: about 2e-4 (the spread of 64 draws)
    assert abs(bias.mean().item()) < 1e-5 and bias.abs().mean().item() < 5e-4, (bias.mean(), bias.abs().mean())
    assert (x.bfloat16().double() - x.double()).abs().mean().item() > 1.5e-3  # to nearest: each element's own error
    shuffled = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
    again = torch.empty_like(out)
    store(again, x[shuffled], "stochastic", torch.tensor(63.0))
    assert torch.equal(again, out[shuffled]), "a value rounds the same way wherever it is"
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, -1.5])
    rounded = torch.empty(6, dtype=torch.bfloat16)
    store(rounded, special, "stochastic", torch.tensor(5.0))
    assert torch.equal(rounded[[0, 1, 3, 4, 5]], special.bfloat16()[[0, 1, 3, 4, 5]]) and rounded[2].isnan()


@pytest.mark.fast
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_trains_bitwise_as_the_plain_module_with_the_same_optimizer(stage, rounding):
    torch.manual_seed(0)
    net = ParityNet()
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(stage, {"exp_avg": "bf16", "exp_avg_sq": "bf16", "rounding": rounding}))
    trained = [p for p in plain.parameters() if p.requires_grad]
    opt = StoredStatesAdamW(trained, lr=LR, weight_decay=0.01, fused=True, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16, rounding=rounding)
    for x, y in make_batches(4, 2):
        engine.backward(engine(x, y))
        engine.step()
        plain(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = engine.consolidated_fp32_state()
    differ = [n for n, p in plain.named_parameters() if p.requires_grad and not torch.equal(state[n], p.detach())]
    assert not differ, f"stage {stage}, {rounding}: {differ}"
    elements = sum(p.numel() for p in trained)
    assert engine.ledger.live_bytes(Category.OPTIM_STATE) == 4 * elements, "two bf16 moments per trained element"
    states = [t for s in engine.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert states and all(t.dtype == torch.bfloat16 for t in states)
    engine.destroy()


def test_the_estimate_predicts_the_stored_states_bytes_exactly():
    for states, per_element in (({"exp_avg": "bf16", "exp_avg_sq": "bf16"}, 4), ({"exp_avg": "bf16"}, 6),
                                ({"exp_avg": "fp32", "exp_avg_sq": "fp16"}, 6), ({}, 8)):
        torch.manual_seed(0)
        cfg = _config(1, states)
        cfg["zeroplus"]["memory_estimate"] = True
        engine = zeroplus.initialize(ParityNet(), cfg)
        for x, y in make_batches(2, 2):
            engine.backward(engine(x, y))
            engine.step()
        elements = sum(g.owned_numel for g in engine.partition.groups)
        measured = engine.ledger.peak_bytes(Category.OPTIM_STATE)
        assert measured == per_element * elements, (states, measured, elements)
        predicted = engine.memory_report().predicted_category_peaks()
        assert predicted is not None and predicted["optim_state"] == measured, (states, predicted)
        engine.destroy()


def test_deepspeed_bf16_optimizer_states_key_stores_both_moments_in_bf16():
    torch.manual_seed(0)
    cfg = _config(2, {}, bf16={"enabled": True, "bf16_optimizer_states": True})
    engine = zeroplus.initialize(ParityNet(), cfg)
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    moments = [t.dtype for s in engine.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert moments and set(moments) == {torch.bfloat16}
    engine.destroy()


@pytest.mark.parametrize("change,message", [
    (dict(optimizer={"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}), "served for Adam and AdamW"),
    (dict(states={"exp_avg": "fp16", "rounding": "stochastic"}), "'zeroplus.optimizer_states.rounding'"),
])
def test_what_cannot_be_stored_is_refused_naming_the_key(change, message):
    states = change.pop("states", None)
    cfg = _config(2, states, **change)
    with pytest.raises(ConfigError, match=message):
        zeroplus.initialize(ParityNet(), cfg)


def _halving(step: int) -> float:
    return 0.5 ** step


def _client_or_block(stage: int, client: bool) -> tuple[dict, list[float], bool, set]:
    """Five steps at ``stage`` with bf16 moments and a schedule halving the learning rate every step: the client's
    AdamW with a ``LambdaLR`` bound to it before ``initialize`` (as the Trainer builds them), or the config's AdamW
    with the same schedule made over it; (weights, losses, whether the engine steps the client's own object, the
    moments' dtypes)."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = ParityNet()
    cfg = _config(stage)
    if client:
        del cfg["optimizer"]
        given = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(given, _halving)
        engine = zeroplus.initialize(model, cfg, optimizer=given, lr_scheduler=schedule)
    else:  # (the client's kernel: torch's loop, where the config's AdamW would be fused)
        cfg["zeroplus"]["fused_optimizer"] = False
        engine = zeroplus.initialize(model, cfg, lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _halving))
    losses = engine_train(engine, make_batches(5 * world, 2), 5, rank, world, 1)
    dtypes = {t.dtype for state in engine.optimizer.state.values() for k, t in state.items() if k != "step"}
    return engine.consolidated_fp32_state(), losses, engine.optimizer is (given if client else None), dtypes


@pytest.mark.parametrize("stage", [1, 3])
def test_a_client_adamw_stores_its_moments_in_place_and_trains_as_the_config_block(stage):
    """A client's torch AdamW with ``bf16_optimizer_states``-style moments (what the Trainer hands over for a config
    with no optimizer block) is made the stored-states AdamW in place: the engine steps the same object, the scheduler
    bound to it before ``initialize`` still sets its rate, and the run is bit for bit the config block's."""
    client = run_distributed(_client_or_block, 2, stage, True)
    block = run_distributed(_client_or_block, 2, stage, False)
    for rank in range(2):
        weights, losses, same, dtypes = client[rank]
        assert same and dtypes == {torch.bfloat16}, (rank, same, dtypes)
        assert losses == block[rank][1], rank
        assert all(torch.equal(weights[n], block[rank][0][n]) for n in weights), rank


@pytest.mark.parametrize("make,message", [
    (lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9), "client optimizer SGD: SGD keeps its states in fp32 only"),
    (lambda ps: torch.optim.AdamW(ps, lr=LR, amsgrad=True), "client optimizer AdamW: .*amsgrad"),
])
def test_a_client_optimizer_the_moments_cannot_be_stored_for_is_refused(make, message):
    model = ParityNet()
    cfg = _config(2)
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match=f"rank 0: config key 'zeroplus.optimizer_states'.*{message}"):
        zeroplus.initialize(model, cfg, optimizer=make(model.parameters()))


def _ranks(stage: int) -> dict:
    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(stage))
    batches = make_batches(5 * world, 2)
    for s in range(5):
        x, y = batches[s * world + rank]
        engine.backward(engine(x, y))
        engine.step()
    owned = sum(g.owned_numel for g in engine.partition.groups)
    assert engine.ledger.live_bytes(Category.OPTIM_STATE) == 4 * owned, "two bf16 moments per owned element"
    return engine.consolidated_fp32_state()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_train_the_plain_modules_model_within_the_rounding(world):
    torch.manual_seed(0)
    plain = ParityNet()
    trained = [p for p in plain.parameters() if p.requires_grad]
    opt = StoredStatesAdamW(trained, lr=LR, weight_decay=0.01, fused=True, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16)
    batches = make_batches(5 * world, 2)
    for s in range(5):
        for r in range(world):
            x, y = batches[s * world + r]
            (plain(x, y) / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    stages = (1, 2, 3) if world == 2 else (3,)
    for stage in stages:
        results = run_distributed(_ranks, world, stage)
        for name, p in plain.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(results[0][name], p.detach(), rtol=0, atol=2e-4 * p.abs().max().item(),
                                           msg=lambda m, n=name: f"world {world}, stage {stage}, {n}: {m}")


def _moments(engine: zeroplus.Engine) -> list[torch.Tensor]:
    """Each flat group's two moments, in the partition's order."""
    return [engine.optimizer.state[g.master_param][k] for g in engine.partition.groups for k in ("exp_avg",
                                                                                              "exp_avg_sq")]


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoints_keep_the_moments_dtype_resume_bitwise_and_convert_into_another(tmp_path, stage):
    """Saved in bf16 (the file's tensors are bf16), resumed bit for bit; loaded into fp32 moments, each is its bf16
    value; an fp32 checkpoint loaded into bf16 moments rounds each to nearest."""
    batches = make_batches(6, 2)
    torch.manual_seed(0)
    straight = zeroplus.initialize(ParityNet(), _config(stage))
    expected = train_steps(straight, batches)
    final = straight.consolidated_fp32_state()
    straight.destroy()
    torch.manual_seed(0)
    first = zeroplus.initialize(ParityNet(), _config(stage))
    train_steps(first, batches[:3])
    first.save_checkpoint(str(tmp_path / "bf16"))
    saved = [t.clone() for t in _moments(first)]
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)
    first.destroy()
    torch.manual_seed(1)
    again = zeroplus.initialize(ParityNet(), _config(stage))
    again.load_checkpoint(str(tmp_path / "bf16"))
    assert train_steps(again, batches[3:]) == expected[3:]
    resumed = again.consolidated_fp32_state()
    assert all(torch.equal(resumed[n], final[n]) for n in final), "resumed bit for bit"
    again.destroy()
    # into fp32 moments: the bf16 values, exactly
    wide = zeroplus.initialize(ParityNet(), _config(stage, {}))
    wide.load_checkpoint(str(tmp_path / "bf16"))
    moments = _moments(wide)
    assert len(moments) == len(saved) and all(t.dtype == torch.float32 for t in moments)
    assert all(torch.equal(t, u.float()) for t, u in zip(moments, saved)), "each moment its bf16 value"
    train_steps(wide, batches[3:4])  # and it steps (torch's fused AdamW over fp32 moments)
    wide.save_checkpoint(str(tmp_path / "fp32"))
    wide_moments = [t.clone() for t in _moments(wide)]
    wide.destroy()
    narrow = zeroplus.initialize(ParityNet(), _config(stage))
    narrow.load_checkpoint(str(tmp_path / "fp32"))
    narrowed = _moments(narrow)
    assert len(narrowed) == len(wide_moments) and all(t.dtype == torch.bfloat16 for t in narrowed)
    assert all(torch.equal(t, u.bfloat16()) for t, u in zip(narrowed, wide_moments)), "rounded to nearest"
    owned = sum(g.owned_numel for g in narrow.partition.groups)
    assert narrow.ledger.live_bytes(Category.OPTIM_STATE) == 4 * owned
    narrow.destroy()


@pytest.mark.parametrize("stage", [1, 3])
def test_shared_master_weights_step_stored_moments_as_a_separate_master_does(stage):
    """bf16 compute: the split master (stepped chunk by chunk, ``chunked_step.py``) with bf16 moments trains bit for
    bit as a separate fp32 master rounded the same way, and both store their moments in bf16."""
    runs = []
    for shared in (True, False):
        torch.manual_seed(0)
        cfg = _config(stage, bf16={"enabled": True})
        cfg["zeroplus"].update(shared_master_weights=shared, master_rounding="like_shared")
        engine = zeroplus.initialize(ParityNet(), cfg)
        losses = train_steps(engine, make_batches(4, 2))
        assert all(t.dtype == torch.bfloat16 for t in _moments(engine)), f"shared {shared}"
        runs.append((losses, engine.consolidated_fp32_state(), [t.clone() for t in _moments(engine)]))
        engine.destroy()
    (losses_a, state_a, moments_a), (losses_b, state_b, moments_b) = runs
    assert losses_a == losses_b
    assert all(torch.equal(state_a[n], state_b[n]) for n in state_a)
    assert all(torch.equal(a, b) for a, b in zip(moments_a, moments_b))
