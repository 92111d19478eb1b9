"""Muon under ZeRO (``zeroplus/optim/muon.py``): ``"optimizer": {"type": "Muon"}`` trains what one process trains with
``torch.optim.Muon`` on the matrices and ``torch.optim.AdamW`` on the rest, at every stage and at 1, 2 and 4 ranks.

``ParityNet`` (``tests/models.py``): matrices whose sizes do not divide by the world size, so at stages 1-3 most are
cut across ranks and made whole for Newton-Schulz by the gather; a tied embedding/head (AdamW: a table looked up);
a frozen layer; gradient accumulation and a binding clip. Tolerance: losses 1e-6 relative and parameters 1e-5
relative with an absolute floor of 1e-5 of each tensor's largest value: Newton-Schulz runs in bf16, so a gradient
that differs from the one process's in its last fp32 bit (the ranks' sums are added in another order) can round
to the neighbouring bf16 value, which moves that element's update by up to 2^-8 of it (lr 0.02 here).
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import MUON_LR, MUON_MOMENTUM, engine_train, reference_train
from zeroplus.config import ConfigError
from zeroplus.ledger import Category
from zeroplus.optim.muon import ShardedMuon

STEPS, GAS, MICRO, LR, CLIP = 4, 2, 2, 1e-2, 0.5
MUON = {"type": "Muon", "params": {"lr": LR, "muon_lr": MUON_LR, "momentum": MUON_MOMENTUM, "weight_decay": 0.01}}


def _config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": MUON, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                                     "reduce_bucket_size": 100, **zero},
            "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _train_every_stage() -> list[dict]:
    rank, world = rank_and_world()
    out = []
    for stage in range(4):
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), _config(stage))
        losses = engine_train(engine, make_batches(STEPS * GAS * world, MICRO), STEPS, rank, world, GAS)
        opt = engine.optimizer
        assert isinstance(opt, ShardedMuon)
        owners = opt.owners()
        momentum = sum(s["momentum_buffer"].numel() for s in opt.state.values() if "momentum_buffer" in s)
        out.append({"losses": losses, "state": engine.consolidated_fp32_state(), "owners": owners,
                    "momentum": momentum, "comm_peak": engine.ledger.peak_bytes(Category.COMM_BUFFER)})
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_muon_at_every_stage_equals_torch_muon_and_adamw_in_one_process(world):
    results = run_distributed(_train_every_stage, world) if world > 1 else [_train_every_stage()]
    torch.manual_seed(0)
    model = ParityNet()
    ref_losses, ref_state = reference_train(model, make_batches(STEPS * GAS * world, MICRO), STEPS, world, GAS, LR,
                                            CLIP, optimizer="Muon")
    matrices = sum(p.numel() for b in model.blocks for p in b.parameters() if p.dim() == 2)
    for stage, result in enumerate(results[0]):
        label = f"ZeRO-{stage} at {world} ranks"
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{label}: losses: {m}")
        for name, ref in ref_state.items():
            if not ref.requires_grad:
                continue
            floor = 1e-5 * ref.abs().max().item()
            torch.testing.assert_close(result["state"][name], ref.detach(), rtol=1e-5, atol=floor,
                                       msg=lambda m, n=name: f"{label}: {n}: {m}")
    for stage in range(4):
        sharded = stage > 0 and world > 1
        per_rank = [r[stage] for r in results]
        # one momentum element per matrix element: the shard's at stages 1-3, the whole at stage 0
        total = sum(r["momentum"] for r in per_rank)
        assert matrices <= total <= (matrices + 3 * world * 4) * (1 if sharded else world), (stage, total, matrices)
        if sharded:  # every rank orthogonalizes some matrix; the buffer is one group's padded fp32 update
            assert all(r["owners"] == list(range(world)) for r in per_rank), (stage, [r["owners"] for r in per_rank])
            assert all(r["comm_peak"] > 0 for r in per_rank)


def test_whole_parameters_step_as_torch_muon_bit_for_bit():
    """No engine: ShardedMuon on whole parameters is torch.optim.Muon beside torch.optim.AdamW, bit for bit."""
    torch.manual_seed(0)
    ref, mine = ParityNet(), ParityNet()
    mine.load_state_dict(ref.state_dict())
    from tests.reference import MuonAndAdamW
    from zeroplus.engine.optimizer_setup import muon_params
    plain = MuonAndAdamW(ref, lr=LR, weight_decay=0.01)
    chosen = muon_params(mine)
    trained = [p for p in mine.parameters() if p.requires_grad]
    opt = ShardedMuon([{"params": [p for p in trained if id(p) in chosen], "use_muon": True, "lr": MUON_LR},
                       {"params": [p for p in trained if id(p) not in chosen], "use_muon": False, "lr": LR}],
                      momentum=MUON_MOMENTUM, weight_decay=0.01)
    for x, y in make_batches(4, MICRO):
        for model, step in ((ref, plain), (mine, opt)):
            model(x, y).backward()
            step.step()
            step.zero_grad(set_to_none=True)
    for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(a, b), name


def test_which_parameters_muon_takes():
    """DeepSpeed's rule (matrices not named embed or lm_head), tables looked up by what their module computes (a
    GPT's wte and wpe), and a parameter's own use_muon tag over both."""
    from zeroplus.engine.optimizer_setup import muon_params
    from zeroplus.models import GPT, gpt_config
    model = GPT(gpt_config("tiny"))
    model.blocks[0].mlp.fc.weight.use_muon = False  # type: ignore[attr-defined]
    names = {id(p): n for n, p in model.named_parameters()}
    taken = sorted(names[i] for i in muon_params(model))
    assert taken == [f"blocks.{b}.{m}.weight" for b in range(2) for m in ("attn.proj", "attn.qkv", "mlp.fc", "mlp.proj")
                     if (b, m) != (0, "mlp.fc")], taken
    assert not any(id(p) in muon_params(ParityNet()) for p in ParityNet().embed.parameters())


@pytest.mark.parametrize("key,value,says", [
    ("offload_optimizer", {"device": "cpu"}, "'zero_optimization.offload_optimizer' is set"),
    ("ns_method", "gram", "'optimizer.params.ns_method' ('gram')"),
    ("per_head_muon", True, "'optimizer.params.per_head_muon' is true"),
    ("nesterov_typo", 1, "'optimizer.params.nesterov_typo' (value 1) is not a parameter of Muon"),
])
def test_what_muon_cannot_do_is_refused_naming_the_key(key, value, says):
    cfg = _config(2)
    if key == "offload_optimizer":
        cfg["zero_optimization"][key] = value
    else:
        cfg["optimizer"] = {"type": "Muon", "params": dict(MUON["params"], **{key: value})}
    model = ParityNet()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"rank 0: .*{says}".replace("(", r"\(").replace(")", r"\)")):
        zeroplus.initialize(model, cfg)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_a_client_torch_muon_is_refused_pointing_at_the_config():
    model = ParityNet()
    opt = torch.optim.Muon([b.up.weight for b in model.blocks])
    with pytest.raises(ConfigError, match="Muon's whole matrices.*'optimizer' block of type 'Muon'"):
        zeroplus.initialize(model, {"train_micro_batch_size_per_gpu": 1}, optimizer=opt)


BUDGET_CASES = [(1, "fp32"), (3, "bf16")]


def _budget_job() -> list[dict]:
    from zeroplus.models import GPT, gpt_config
    out = []
    for stage, dtype in BUDGET_CASES:
        torch.manual_seed(0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": MUON, "bf16": {"enabled": dtype == "bf16"},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 500,
                                     "reduce_bucket_size": 3000}, "zeroplus": {"log_level": "warning"}}
        engine = zeroplus.initialize(GPT(gpt_config("tiny")), cfg)
        x = torch.randint(0, 256, (2, 16))
        for _ in range(3):
            engine.backward(engine(x, x))
            engine.step()
        opt = engine.optimizer
        muon_owned = sum(g.owned_numel for g in engine.partition.groups if opt.takes_matrices(g.master_param))
        adam_owned = sum(g.owned_numel for g in engine.partition.groups if not opt.takes_matrices(g.master_param))
        widest = max(g.padded_numel for g in engine.partition.groups if opt.takes_matrices(g.master_param))
        out.append({"measured": {c.value: engine.ledger.peak_bytes(c) for c in Category},
                    "predicted": dict(engine.budget.category_peaks), "muon": muon_owned, "adam": adam_owned,
                    "widest": widest, "states": engine.ledger.live_bytes(Category.OPTIM_STATE)})
        engine.destroy()
    return out


def test_the_budget_predicts_every_category_and_a_matrix_keeps_one_state():
    """Every ledger category's peak as the estimate predicts it (its simulation runs Muon's step, gather and
    buffer included); optimizer states: 4 bytes per owned matrix element, 8 per other element, plus AdamW's step
    counts; the gather's buffer: the widest Muon group's padded fp32 update."""
    for rank_result in run_distributed(_budget_job, 2):
        for (stage, dtype), r in zip(BUDGET_CASES, rank_result):
            measured, predicted = dict(r["measured"]), dict(r["predicted"])
            lag = measured.pop("comm_buffer") - predicted.pop("comm_buffer")  # gloo frees a buffer a moment late
            assert 0 <= lag <= 66_000, (stage, lag)
            assert predicted.pop("grad") <= measured.pop("grad")  # (the same late release: test_estimate.py)
            assert measured == {k: predicted[k] for k in measured}, (stage, dtype, predicted, measured)
            assert 4 * r["muon"] + 8 * r["adam"] <= r["states"] <= 4 * r["muon"] + 8 * r["adam"] + 64 * 32, r
            assert r["measured"]["comm_buffer"] >= 4 * r["widest"], r


def _resume_job(root: str) -> list[bool]:
    rank, world = rank_and_world()
    batches = make_batches(2 * STEPS * GAS * world, MICRO)
    same = []
    for stage in (1, 3):
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), _config(stage))
        engine_train(engine, batches, 2, rank, world, GAS)
        engine.save_checkpoint(f"{root}/{stage}")
        straight = engine_train(engine, batches, 2, rank, world, GAS, start=2)
        engine.destroy()
        torch.manual_seed(1)
        resumed = zeroplus.initialize(ParityNet(), _config(stage))
        resumed.load_checkpoint(f"{root}/{stage}")
        same.append(engine_train(resumed, batches, 2, rank, world, GAS, start=2) == straight)
        resumed.destroy()
    return same


def test_a_checkpoint_resumes_muon_bit_for_bit(tmp_path):
    """The momentum buffers are saved with the shards and read back: the resumed run's losses are the straight
    run's, bit for bit, at stages 1 and 3."""
    assert run_distributed(_resume_job, 2, str(tmp_path)) == [[True, True]] * 2


def test_deepspeeds_api_builds_muon_from_the_same_config():
    """``deepspeed.initialize`` (zeroplus's DeepSpeed API, one rank) with the Muon block: the same optimizer, the
    same first steps as ``zeroplus.initialize``."""
    import zeroplus.deepspeed_api as deepspeed
    losses = []
    for make in (lambda m, c: zeroplus.initialize(m, c),
                 lambda m, c: deepspeed.initialize(model=m, model_parameters=m.parameters(), config=c)[0]):
        torch.manual_seed(0)
        engine = make(ParityNet(), dict(_config(1), gradient_accumulation_steps=1))
        assert sorted(g["use_muon"] for g in engine.optimizer.param_groups) == [False, True]  # (DeepSpeed's facade)
        losses.append([])
        for x, y in make_batches(3, MICRO):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[-1].append(loss.item())
        engine.destroy()
    assert losses[0] == losses[1], losses


def test_a_parameter_of_more_than_two_dimensions_steps_as_its_first_dimension_against_the_rest():
    """A convolution's filters (out, in, k, k), as DeepSpeed's Muon views them: the (out, in * k * k) matrix stepped
    as torch.optim.Muon steps it, reshaped back."""
    torch.manual_seed(0)
    conv = torch.nn.Parameter(torch.randn(8, 3, 3, 3))
    flat = torch.nn.Parameter(conv.detach().reshape(8, 27).clone())
    ours = ShardedMuon([{"params": [conv], "use_muon": True}], lr=0.02)
    theirs = torch.optim.Muon([flat], lr=0.02, weight_decay=0.0)
    for _ in range(3):
        grad = torch.randn(8, 3, 3, 3)
        conv.grad, flat.grad = grad.clone(), grad.reshape(8, 27).clone()
        ours.step()
        theirs.step()
    assert torch.equal(conv.detach().reshape(8, 27), flat.detach())
