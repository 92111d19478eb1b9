"""AutoEP (``zeroplus/parallel/autoep.py``): a Hugging Face mixture of experts split over the expert group by its own
plan when the config says ``"expert_parallel": {"enabled": true, "autoep_size": E}``, against the model in one
process.

4 gloo ranks in one world, its groups reset between cases: Mixtral and Qwen3-MoE (hidden 64, 4 experts, top-2;
each rank its own batch) at expert 2 (ZeRO partitions the experts over the expert-data pairs) and expert 4 (one
expert per rank), between them ZeRO-1, 2 and 3; at ZeRO-3, DeepSeek-V3 at expert 2 (grouped sigmoid routing, a
shared expert, a dense first layer) and GPT-OSS at expert 4 (experts laid out ``(experts, in, out)`` with biases).
The reference: the plain model on all four ranks' batches, SGD
with momentum and a clip the gradients exceed (a norm that missed other ranks' experts, or counted the router
twice, would change every update). Checked: each rank holds its experts only, the losses each rank reports, the
global gradient norm, and every parameter after training (this rank's experts of each expert weight), within 1e-5
relative (absolute floor 1e-6). At ZeRO-3: ``save_pretrained`` writes the whole trained model (each expert group's
experts all-gathered), which ``from_pretrained`` loads equal to the reference; the same model built on the meta
device gets the normally built model's experts, and ``load_pretrained`` reads the trained ones, bit for bit.
The first forward's memory estimate (routing assumed balanced on the meta device) predicts every model-state
category of Mixtral at expert 2, ZeRO-3, as the ledger measures it. Broken once (the combine's routing weights left
out): fails. Refused, naming the
key, the rank and the reason, with the model left whole: an expert count E does not divide, a model without
experts (Llama), expert and tensor parallelism together, an ``autoep_size`` without ``enabled``, and a capacity
factor with no experts split. With ``zeroplus.parallel.expert_capacity_factor`` 1.0 (Mixtral, expert 2, ZeRO-2)
each rank drops the pairs over its experts' capacity as the reference (the same rule, applied in one process to
each rank's batch) does, and equals it (without the drop in the dispatch: fails).
"""
from __future__ import annotations

import math

import pytest
import torch
import transformers

import zeroplus
import zeroplus.deepspeed_api as deepspeed
from tests.dist_helper import run_distributed
from tests.hf_models import build
from tests.parallel import test_autotp as autotp
from tests.parallel.model_states import assert_model_states_predicted, hf_steps, ledger_peaks, local_params
from tests.reference import clip_global_norm
from zeroplus.config import ConfigError
from zeroplus.engine.checkpoints.hf_export import export_checkpoint

STEPS, MICRO, SEQ, CLIP, LR, WORLD = 3, 2, 16, 0.5, 0.05, 4
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
CASES = (("mixtral", 2, 1), ("mixtral", 2, 3), ("mixtral", 4, 2), ("qwen3_moe", 2, 2), ("qwen3_moe", 4, 3),
         ("deepseek_v3", 2, 3), ("gpt_oss", 4, 3))
CAPACITY = ("mixtral", 2, 2, 1.0)  # (family, expert, stage, zeroplus.parallel.expert_capacity_factor)
EXPERTS = 4
ESTIMATED = ("mixtral", 2, 3)  # the case whose first forward's memory estimate is checked


def _config(expert: int, stage: int, estimate: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "expert_parallel": {"enabled": True, "autoep_size": expert},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": estimate}}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "deepseek_v3":  # latent attention; a dense layer, then grouped sigmoid routing beside a shared expert
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1))
    if family == "gpt_oss":  # experts laid out (experts, in, out) with biases, gate and up interleaved; attention sinks
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=8,
            eos_token_id=0, pad_token_id=1))
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=2))
    return build(family, "tiny")


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (MICRO, SEQ), generator=g) for _ in range(WORLD * STEPS)]


def _job(root: str) -> list[dict]:
    out = []
    for family, expert, stage, *capacity in (*CASES, CAPACITY):
        zeroplus.parallel.reset_parallel()
        cfg = _config(expert, stage, estimate=(family, expert, stage) == ESTIMATED)
        if capacity:
            cfg["zeroplus"]["parallel"] = {"expert_capacity_factor": capacity[0]}
        parallel = zeroplus.init_parallel(cfg)
        engine = zeroplus.initialize(_model(family), cfg)
        losses, norms = hf_steps(engine, _batches()[parallel.data.rank::WORLD])
        params = _named(engine)
        held = {n: tuple(v.shape) for n, v in params.items() if ".experts." in n}
        out.append({"case": (family, expert, stage, *capacity), "losses": losses, "norms": norms, "params": params,
                    "held": held, "expert_rank": parallel.expert.rank, "data_rank": parallel.data.rank,
                    "ledger": ledger_peaks(engine),
                    "predicted": engine.budget.category_peaks if engine.budget is not None else None})
        if stage == 3:  # the whole model, each expert group's experts put back together, in Hugging Face's files
            engine.save_pretrained(f"{root}/{family}-{expert}", dtype="fp32")
            engine.save_checkpoint(f"{root}/{family}-{expert}-checkpoint")
        engine.destroy()
        if stage == 3:
            out[-1]["built"], out[-1]["loaded"] = _on_meta_then_loaded(family, cfg, f"{root}/{family}-{expert}")
    zeroplus.parallel.reset_parallel()
    return out


def _named(engine) -> dict[str, torch.Tensor]:
    return {n.split("@")[0]: v for n, v in local_params(engine).items()}  # (an expert group's: name@epN)


def _on_meta_then_loaded(family: str, cfg: dict, path: str) -> tuple[dict, dict]:
    """The model built on the meta device and split: its experts as initialize builds them (from its config, cut),
    then as load_pretrained reads them from the exported files (each rank its experts' bytes)."""
    with torch.device("meta"):
        model = _model(family)
    engine = zeroplus.initialize(model, cfg)
    built = _named(engine)
    engine.load_pretrained(path)
    loaded = _named(engine)
    engine.destroy()
    return built, loaded


def _dropping(model: torch.nn.Module, factor: float, dropped: list[int]) -> None:
    """The reference's own capacity: each experts call keeps at most ceil(k x tokens / experts x factor) pairs per
    expert, earlier choices then earlier tokens first; a dropped pair's routing weight is multiplied by 0 (no share
    of the output, no gradient). ``dropped`` counts the pairs dropped."""
    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        hidden, index, weights = args
        tokens, k = index.shape
        cap, used = math.ceil(k * tokens / EXPERTS * factor), torch.zeros(EXPERTS, dtype=torch.long)
        kept = torch.zeros_like(weights)
        for j in range(k):
            onehot = torch.nn.functional.one_hot(index[:, j], EXPERTS)
            kept[:, j] = ((onehot.cumsum(0) - 1 + used).gather(1, index[:, j:j + 1]).squeeze(1) < cap).float()
            used += onehot.sum(0)
        dropped.append(int((kept == 0).sum()))
        return hidden, index, weights * kept
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            m.register_forward_pre_hook(hook)


def _reference(family: str, capacity: float | None = None) -> tuple[list[list[float]], list[float],
                                                                      dict[str, torch.Tensor]]:
    model, batches = _model(family), _batches()
    dropped: list[int] = []
    if capacity is not None:
        _dropping(model, capacity, dropped)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    norms = []
    for s in range(STEPS):
        for r in range(WORLD):
            ids = batches[WORLD * s + r]
            loss = model(input_ids=ids, labels=ids).loss
            (loss / WORLD).backward()
            losses[r].append(loss.item())
        norms.append(clip_global_norm(list(model.parameters()), CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert capacity is None or sum(dropped) > 0, "the capacity must drop pairs, or it is not tested"
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def test_hugging_face_experts_split_by_their_plan_train_as_one_process(tmp_path):
    ranks = run_distributed(_job, WORLD, str(tmp_path))
    references = {(family,): _reference(family) for family in FAMILIES}
    references[(CAPACITY[0], CAPACITY[3])] = _reference(CAPACITY[0], CAPACITY[3])
    for rank, results in enumerate(ranks):
        for got in results:
            family, expert, stage, *capacity = got["case"]
            ref_losses, ref_norms, dense = references[(family, *capacity)]
            assert ref_norms[0] > CLIP, "the clip must act, or the norm is not tested"
            label = f"{family}, expert {expert}, ZeRO-{stage}, {capacity or 'dropless'}, rank {rank}"
            local, first = EXPERTS // expert, got["expert_rank"] * (EXPERTS // expert)
            assert got["held"] and all(shape[0] == local for shape in got["held"].values()), f"{label}: {got['held']}"
            assert got["losses"] == pytest.approx(ref_losses[got["data_rank"]], rel=1e-5), label
            assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"{label}: gradient norms"
            assert (got["predicted"] is not None) == (got["case"] == ESTIMATED), label
            if got["predicted"] is not None:  # this rank's experts and the rest, as the ledger measures them
                assert_model_states_predicted(got["ledger"], label, engine=got["predicted"])
            for name, value in dense.items():
                if name == "lm_head.weight" and name not in got["params"]:
                    continue  # (tied to the embedding)
                expected = value[first:first + local] if name in got["held"] else value
                torch.testing.assert_close(got["params"][name], expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"{label}, {n}: {m}")
            if "loaded" in got:  # a meta-device model: built as the normal one, then the trained one loaded
                initial = {n: p.detach() for n, p in _model(family).named_parameters()}
                for name, value in got["built"].items():
                    expected = initial[name][first:first + local] if name in got["held"] else initial[name]
                    assert torch.equal(value, expected), f"{label}: {name} built on meta"
                for name, value in got["loaded"].items():
                    assert torch.equal(value, got["params"][name]), f"{label}: {name} loaded"
    for family, expert, stage in CASES:
        if stage == 3:
            # every expert, whole (the slices: checked above): as save_pretrained wrote it, and as the checkpoint's
            # expert groups join offline (zeroplus convert: Hugging Face files, one state dict)
            checkpoint = str(tmp_path / f"{family}-{expert}-checkpoint")
            export_checkpoint(checkpoint, str(tmp_path / f"{family}-{expert}-offline"))
            state = zeroplus.load_fp32_state_dict(checkpoint)
            dense = references[(family,)][2]
            for how in ("", "-offline"):
                exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{family}-{expert}{how}",
                                                                             dtype=torch.float32)
                for name, value in exported.named_parameters():
                    torch.testing.assert_close(value.detach(), dense[name], rtol=1e-5, atol=1e-6,
                                               msg=lambda m, n=name: f"{family}-{expert}{how}, {n}: {m}")
            for name, value in dense.items():
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"{family}, expert {expert}, state dict {n}: {m}")


def _refused(model: torch.nn.Module, cfg: dict) -> str:
    before = {n: tuple(p.shape) for n, p in model.named_parameters()}
    zeroplus.parallel.reset_parallel()
    try:
        zeroplus.init_parallel(cfg)
        zeroplus.initialize(model, cfg)
    except ConfigError as err:
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == before, "the model was changed"
        return str(err)
    finally:
        zeroplus.parallel.reset_parallel()
    return "initialized"


def _refusals() -> list[str]:
    three = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2))
    spanning = dict(_config(2, 1), tensor_parallel={"autotp_size": 2})
    spanning["zeroplus"] = dict(spanning["zeroplus"], parallel={"experts_span_tensor": True})
    split_first = _model("mixtral")  # by tensor alone: DeepSpeed's tp_model_init given no config
    deepspeed.tp_model_init(split_first, 2)
    return [_refused(three, _config(2, 1)), _refused(build("llama", "tiny"), _config(2, 1)),
            _refused(_model("mixtral"), spanning),
            _refused(split_first, dict(_config(2, 1), tensor_parallel={"autotp_size": 2})),
            _refused(_model("mixtral"), dict(
                _config(2, 1), expert_parallel={"autoep_size": 2})), _refused(_model("mixtral"), _capacity_alone())]


def _capacity_alone() -> dict:
    """A capacity factor with no experts split (expert size 1): a key that would change nothing."""
    cfg = _config(1, 1)
    cfg["zeroplus"]["parallel"] = {"expert_capacity_factor": 1.0}
    return cfg


def test_what_autoep_cannot_split_is_refused_on_every_rank_naming_it():
    for rank, (uneven, dense, spanning, split_first, disabled, alone) in enumerate(run_distributed(_refusals, 4)):
        assert "experts were split by tensor already" in split_first, split_first
        # split both ways, expert groups drawn across tensor ranks: each token would reach the experts twice
        assert "with 'zeroplus.parallel.experts_span_tensor'" in spanning and "set experts_span_tensor false" in \
            spanning, spanning
        assert "'zeroplus.parallel.expert_capacity_factor' is 1.0" in alone and "no experts are split" in alone, alone
        key = f"'expert_parallel.autoep_size' / 'zeroplus.parallel.expert' is 2 (rank {rank})"
        assert key in uneven and "num_experts = 3, not divisible by 2" in uneven, uneven
        assert key in dense and "a LlamaForCausalLM, has no expert layer zeroplus splits" in dense, dense
        assert "'expert_parallel.enabled' is false" in disabled, disabled


def _both_ways(root: str) -> list[dict]:
    """Mixtral at tensor 2 x expert 2 (data 2: each expert group two data ranks of one tensor rank), ZeRO-1 and 3:
    attention, embeddings and head split by the tensor plan, the experts by the expert plan (the tensor plan's
    entries on the experts left out), the router whole. At ZeRO-3: the first forward's estimate, save_pretrained,
    a checkpoint, and the model built on meta and loaded back."""
    out = []
    for stage in (1, 3):
        zeroplus.parallel.reset_parallel()
        cfg = dict(autotp._config(stage, estimate=stage == 3), expert_parallel={"enabled": True, "autoep_size": 2})
        parallel = zeroplus.init_parallel(cfg)
        engine = zeroplus.initialize(_model("mixtral"), cfg)
        losses, norms = hf_steps(engine, autotp._batches()[parallel.data.rank::2])
        got = {"stage": stage, "losses": losses, "norms": norms, "params": _named(engine),
               "tensor_rank": parallel.tensor.rank, "expert_rank": parallel.expert.rank,
               "data_rank": parallel.data.rank,
               "layout": parallel.topology.describe(), "ledger": ledger_peaks(engine),
               "predicted": engine.budget.category_peaks if engine.budget is not None else None}
        if stage == 3:
            engine.save_pretrained(f"{root}/live", dtype="fp32")
            engine.save_checkpoint(f"{root}/checkpoint")
        engine.destroy()
        if stage == 3:
            got["built"], got["loaded"] = _on_meta_then_loaded("mixtral", cfg, f"{root}/live")
        out.append(got)
    zeroplus.parallel.reset_parallel()
    return out


def test_a_mixture_of_experts_split_both_ways_trains_as_one_process(tmp_path):
    """Tensor 2 x expert 2 on 4 ranks against the plain model on the 2 data ranks' batches (``test_autotp``'s
    reference): losses, gradient norms and every weight (this tensor rank's slice, this expert rank's experts)
    within 1e-5; at ZeRO-3 the estimate's model states as the ledger measures them, and the whole model exported
    live and joined offline from the checkpoint equal to the reference, and loaded back bit for bit."""
    ranks = run_distributed(_both_ways, WORLD, str(tmp_path))
    ref_losses, ref_norms, dense = autotp._reference("mixtral")
    local = EXPERTS // 2
    for rank, results in enumerate(ranks):
        for got in results:
            label = f"tensor 2 x expert 2, ZeRO-{got['stage']}, rank {rank}"
            assert got["layout"].startswith("4 ranks = data 2 x tensor 2 x pipeline 1 x expert 2"), got["layout"]
            assert got["losses"] == pytest.approx(ref_losses[got["data_rank"]], rel=1e-5), label
            assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"{label}: gradient norms"
            if got["predicted"] is not None:
                assert_model_states_predicted(got["ledger"], label, engine=got["predicted"])
            first = got["expert_rank"] * local
            for name, value in dense.items():
                expected = value[first:first + local] if ".experts." in name else \
                    autotp._slice("mixtral", name, value, got["tensor_rank"])
                torch.testing.assert_close(got["params"][name], expected, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"{label}, {n}: {m}")
            for name, value in got.get("loaded", {}).items():
                assert torch.equal(value, got["params"][name]), f"{label}: {name} loaded"
        assert ranks[rank][-1]["predicted"] is not None, "the ZeRO-3 run's estimate"
    export_checkpoint(str(tmp_path / "checkpoint"), str(tmp_path / "offline"))
    for how in ("live", "offline"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / how, dtype=torch.float32)
        for name, value in model.named_parameters():
            torch.testing.assert_close(value.detach(), dense[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"exported {how}, {n}: {m}")
