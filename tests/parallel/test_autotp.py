"""AutoTP (``zeroplus/parallel/autotp.py``): a Hugging Face causal LM split by its own tensor-parallel plan when the
config says ``"tensor_parallel": {"autotp_size": 2}``, against the model in one process.

4 gloo ranks, tensor 2 x data 2, ZeRO stages 1 and 3 (the Llama at 0 and 2 too) in one world: each rank builds the same
tiny Llama, Qwen2, Mistral, Qwen3, Mixtral, Qwen3-MoE, a Llama with one key/value head and a tied head, and at
ZeRO-3 only Olmo2 (attention run whole: ``o_proj`` takes its part of the input), DeepSeek-V2 (latent attention: the
latent projection whole, its rotary part's gradient summed), Llama 4's text model (experts' weights laid out
``(experts, in, out)``) and Granite-SWA (attention sinks cut by heads) (hidden 64, 4
query heads, 2 key/value heads: one per tensor rank; Qwen2's q/k/v biases split with them; Qwen3's per-head q/k norms
whole, their gradients summed over the tensor group), and ``initialize`` splits ``q/k/v/gate/up_proj`` by rows,
``o/down_proj`` by columns, the input embeddings and the head by vocabulary rows (the tied head sharing the embeddings'
slice), Mixtral's and Qwen3-MoE's experts' ``gate_up_proj`` by the rows of its gate and of its up projection each and
``down_proj`` by columns (the router whole), and keeps the one key/value head whole on both ranks, each computing it.
The reference: the plain model on both data ranks' batches, SGD with momentum (Adam would turn a gradient's last-bit
difference where it is near zero into a full step) and a clip the gradients exceed (a norm that counted the replicated
norms twice would change every update). Checked: which modules are split, the losses each rank reports, the global
gradient norm, and every parameter slice after training, within 1e-5 relative (absolute floor 1e-6); at ZeRO-3 the
first forward's estimate predicts every model-state category of the split Llama as the ledger measures it, and so does
``zeroplus.estimate`` of the Llama as built, unsplit (it splits its meta copy by the plan); ``save_pretrained`` writes
the whole trained model (its slices all-gathered over the tensor group and joined), which ``from_pretrained`` loads
equal to the reference, as it does the checkpoint's parts joined offline (``zeroplus convert``'s files; and
``load_fp32_state_dict``); the same model built on the meta device and split gets, at ``initialize``, the normally built
model's slices, and ``load_pretrained`` of the exported files reads the trained slices, bit for bit.
Refused, naming the key, the rank and the reason, with the model left as it was:
key/value heads T neither divides nor is a multiple of, a plan style not split yet (a user's plan naming
``sequence_parallel``), a head tied to embeddings the plan leaves whole, a model built under ``zeroplus.Init``
(partitioned parameters), and a refusal after the split (Muon under tensor parallelism), which puts the model's own
modules back.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import zeroplus
import zeroplus.deepspeed_api as deepspeed
from tests.dist_helper import run_distributed
from tests.hf_models import build
from tests.parallel.model_states import assert_model_states_predicted, hf_steps, ledger_peaks, local_params
from tests.reference import clip_global_norm
from zeroplus.config import ConfigError
from zeroplus.engine.checkpoints.hf_export import export_checkpoint
from zeroplus.parallel.tensor_layers import (
    ColumnParallelLinear,
    ReplicatedRowsLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

STEPS, MICRO, SEQ, CLIP, LR = 3, 2, 16, 0.5, 0.05
FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen3_moe", "llama-kv1", "olmo2", "deepseek_v2", "llama4",
            "granite_swa")
LATER = ("olmo2", "deepseek_v2", "llama4", "granite_swa")  # (ZeRO-3 only: their styles' slices, exports and loads)
COLWISE = ("q_proj", "k_proj", "v_proj", "kv_b_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
ROWWISE = ("o_proj", "down_proj")
SPLIT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ReplicatedRowsLinear)


def _config(stage: int, estimate: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
            "tensor_parallel": {"autotp_size": 2},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": estimate}}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (MICRO, SEQ), generator=g) for _ in range(2 * STEPS)]


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama-kv1":  # one key/value head for two tensor ranks, the head tied to the embeddings
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, tie_word_embeddings=True))
    if family == "olmo2":  # q/k/v gathered for norms over all heads, attention whole, o_proj split from it
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, eos_token_id=0, pad_token_id=1))
    if family == "deepseek_v2":  # latent attention; one dense layer, then experts beside shared experts
        return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1))
    if family == "llama4":  # experts' weights (experts, in, out): gate_up_proj packed by columns
        return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
            vocab_size=256, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=1))
    if family == "granite_swa":  # attention sinks, one per head: this rank's heads'; the head tied
        return transformers.GraniteSWAForCausalLM(transformers.GraniteSWAConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=0, eos_token_id=0))
    if family == "qwen3_moe":  # (its experts packed as Mixtral's, per-head q/k norms as Qwen3's)
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2))
    return build(family, "tiny")


def _expected_split(family: str) -> list[str]:
    mlp = [] if family in ("mixtral", "qwen3_moe") else ["gate_proj", "up_proj", "down_proj"]  # (experts: weights)
    if family == "deepseek_v2":  # (the latent kv_a_proj_with_mqa whole; layer 1's MLP its shared experts)
        return sorted(["q_proj", "kv_b_proj", "o_proj", *mlp] * 2 + ["embed_tokens", "lm_head"])
    return sorted(["q_proj", "k_proj", "v_proj", "o_proj", *mlp] * 2 + ["embed_tokens", "lm_head"])


def _job(root: str) -> list[dict]:
    out = []
    for family in FAMILIES:
        for stage in (0, 1, 2, 3) if family == "llama" else (3,) if family in LATER else (1, 3):
            cfg = _config(stage, estimate=(family, stage) == ("llama", 3))
            parallel = zeroplus.init_parallel(cfg)
            engine = zeroplus.initialize(_model(family), cfg)
            split = {n: type(m).__name__ for n, m in engine.module.named_modules() if isinstance(m, SPLIT)}
            losses, norms = hf_steps(engine, _batches()[parallel.data.rank::2])
            params = local_params(engine)
            if stage == 3:  # the whole model, its slices put back together, in Hugging Face's files; its checkpoint
                engine.save_pretrained(f"{root}/{family}", dtype="fp32")
                engine.save_checkpoint(f"{root}/{family}-checkpoint")
            out.append({"family": family, "stage": stage, "losses": losses, "norms": norms, "params": params,
                        "split": split, "tensor_rank": parallel.tensor.rank, "data_rank": parallel.data.rank,
                        "ledger": ledger_peaks(engine),
                        "predicted": engine.budget.category_peaks if engine.budget is not None else None})
            engine.destroy()
            if stage == 3:
                out[-1]["built"], out[-1]["loaded"] = _on_meta_then_loaded(family, f"{root}/{family}")
            if out[-1]["predicted"] is not None:  # zeroplus.estimate of the model as the user has it, unsplit
                out[-1]["estimated"] = zeroplus.estimate(_model(family), cfg, world_size=4, rank=parallel.global_rank,
                                                         seq_len=SEQ).category_peaks
    return out


def _on_meta_then_loaded(family: str, path: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model built on the meta device and split: its slices as initialize builds them (from its config, cut),
    then as load_pretrained reads them from the exported files (each rank its slice's runs of each tensor)."""
    with torch.device("meta"):
        model = _model(family)
    engine = zeroplus.initialize(model, _config(3))
    built = local_params(engine)
    engine.load_pretrained(path)
    loaded = local_params(engine)
    engine.destroy()
    return built, loaded


def _reference(family: str) -> tuple[list[list[float]], list[float], dict[str, torch.Tensor]]:
    model, batches = _model(family), _batches()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses: list[list[float]] = [[], []]
    norms = []
    for s in range(STEPS):
        for r in range(2):
            ids = batches[2 * s + r]
            loss = model(input_ids=ids, labels=ids).loss
            (loss / 2).backward()
            losses[r].append(loss.item())
        norms.append(clip_global_norm(list(model.parameters()), CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def _slice(family: str, name: str, value: torch.Tensor, tensor_rank: int) -> torch.Tensor:
    module = name.rsplit(".", 2)[-2]
    if name.endswith("experts.gate_up_proj"):  # (experts, [gate; up], hidden), Llama 4's (experts, hidden, [gate; up])
        dim = 2 if family == "llama4" else 1
        return torch.cat([part.chunk(2, dim)[tensor_rank] for part in value.chunk(2, dim)], dim)
    if name.endswith("experts.down_proj"):  # (experts, hidden, intermediate), Llama 4's (experts, intermediate, hidden)
        return value.chunk(2, 1 if family == "llama4" else 2)[tensor_rank]
    if name.endswith("self_attn.sinks"):  # (heads,)
        return value.chunk(2, 0)[tensor_rank]
    if family == "llama-kv1" and module in ("k_proj", "v_proj"):
        return value  # whole on every rank: one head, read by both
    if module in COLWISE:
        return value.chunk(2, 0)[tensor_rank]
    if module in ROWWISE and name.endswith(".weight"):
        return value.chunk(2, 1)[tensor_rank]
    return value


def test_hugging_face_models_split_by_their_plan_train_as_one_process(tmp_path):
    ranks = run_distributed(_job, 4, str(tmp_path))
    for family in FAMILIES:
        ref_losses, ref_norms, dense = _reference(family)
        assert ref_norms[0] > CLIP, "the clip must act, or the norm is not tested"
        for rank, results in enumerate(ranks):
            for got in (r for r in results if r["family"] == family):
                label = f"{family}, ZeRO-{got['stage']}, rank {rank}"
                assert sorted(n.rsplit(".", 1)[-1] for n in got["split"]) == _expected_split(family), \
                    f"{label}: {got['split']}"
                kv = {n: t for n, t in got["split"].items() if t == "ReplicatedRowsLinear"}
                assert len(kv) == (4 if family == "llama-kv1" else 0), f"{label}: {kv}"
                assert got["losses"] == pytest.approx(ref_losses[got["data_rank"]], rel=1e-5), label
                assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"{label}: gradient norms"
                assert (got["predicted"] is not None) == ((family, got["stage"]) == ("llama", 3)), label
                if got["predicted"] is not None:  # the first forward's estimate, of this rank's slices
                    assert_model_states_predicted(got["ledger"], label, engine=got["predicted"],
                                                  estimate=got["estimated"])
                for name, value in dense.items():
                    if name == "lm_head.weight" and name not in got["params"]:
                        continue  # (tied to the embedding)
                    expected = _slice(family, name, value, got["tensor_rank"])
                    torch.testing.assert_close(got["params"][name], expected, rtol=1e-5, atol=1e-6,
                                               msg=lambda m, n=name: f"{label}, {n}: {m}")
                if "loaded" in got:  # a meta-device model: built as the normal one, then the trained one loaded
                    initial = {n: p.detach() for n, p in _model(family).named_parameters()}
                    for name, value in got["built"].items():
                        assert torch.equal(value, _slice(family, name, initial[name], got["tensor_rank"])), \
                            f"{label}: {name} built on meta"
                    for name, value in got["loaded"].items():
                        assert torch.equal(value, got["params"][name]), f"{label}: {name} loaded"
        _assert_exported_whole(tmp_path, family, dense)


def _assert_exported_whole(root, family: str, dense: dict[str, torch.Tensor]) -> None:
    """The ZeRO-3 run's model whole (its slices: checked above): as save_pretrained wrote it live, and as its
    checkpoint's slices join offline (``zeroplus convert``'s two formats: Hugging Face files, one state dict)."""
    export_checkpoint(str(root / f"{family}-checkpoint"), str(root / f"{family}-offline"))
    state = zeroplus.load_fp32_state_dict(str(root / f"{family}-checkpoint"))
    assert set(state) == set(dense) | {"lm_head.weight"}, f"{family}: {sorted(set(state) ^ set(dense))}"
    for how in ("live", "offline", "state dict"):
        if how == "state dict":
            values = state
        else:
            path = root / (family if how == "live" else f"{family}-offline")
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            values = {n: p.detach() for n, p in model.named_parameters()}
        for name, value in dense.items():
            torch.testing.assert_close(values[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{family}, exported {how}, {n}: {m}")


def _uneven_key_value_heads() -> torch.nn.Module:
    """Six query heads, three key/value heads: two tensor ranks neither split nor share them."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=3))


def _sequence_parallel_norms() -> torch.nn.Module:
    """A plan edited as a user may, naming Transformers' 'sequence_parallel' for the norms: a style not split yet."""
    model = _model("llama")
    model.tp_plan["model.layers.*.input_layernorm"] = "sequence_parallel"
    return model


def _tied_head_of_a_whole_embedding() -> torch.nn.Module:
    """The head tied to the embeddings, and the plan (edited as a user may) leaving the embeddings whole: splitting
    the head alone would break the tie."""
    model = _model("llama-kv1")
    del model.tp_plan["model.embed_tokens"]
    return model


def _refused(model: torch.nn.Module) -> str:
    before = {n: (type(m), tuple(getattr(m, "weight", torch.empty(0)).shape)) for n, m in model.named_modules()}
    try:
        zeroplus.initialize(model, _config(1))
    except ConfigError as err:
        after = {n: (type(m), tuple(getattr(m, "weight", torch.empty(0)).shape)) for n, m in model.named_modules()}
        assert after == before, "the model was changed"
        return str(err)
    return "initialized"


def _refused_after_the_split() -> str:
    """A Llama AutoTP splits, then a later check refuses (Muon under tensor parallelism): the model comes back whole,
    its linears the model's own."""
    model = _model("llama")
    before = {n: (type(m), tuple(getattr(m, "weight", torch.empty(0)).shape)) for n, m in model.named_modules()}
    try:
        zeroplus.initialize(model, dict(_config(1), optimizer={"type": "Muon", "params": {"lr": 1e-3}}))
    except ConfigError as err:
        after = {n: (type(m), tuple(getattr(m, "weight", torch.empty(0)).shape)) for n, m in model.named_modules()}
        assert after == before, "the model was left split"
        return str(err)
    return "initialized"


def _refusals() -> list[str]:
    with zeroplus.Init():  # (no config: partitioned over the world, as a script may build it)
        partitioned = _model("llama")
    return [_refused(_uneven_key_value_heads()), _refused(_sequence_parallel_norms()),
            _refused(_tied_head_of_a_whole_embedding()), _refused_after_the_split(), _refused(partitioned)]


def test_what_autotp_cannot_split_is_refused_on_every_rank_naming_it():
    for rank, (heads, style, tied, later, partitioned) in enumerate(run_distributed(_refusals, 2)):
        assert "built under zeroplus.Init" in partitioned and f"(rank {rank})" in partitioned, partitioned
        assert "lm_head.weight is tied to model.embed_tokens's, which the plan does not split" in tied, tied
        assert "'optimizer.type' is 'Muon' and 'zeroplus.parallel.tensor' is set" in later, later
        assert f"'tensor_parallel.autotp_size' / 'zeroplus.parallel.tensor' is 2 (rank {rank})" in heads, heads
        assert "num_key_value_heads = 3 (neither a multiple nor a divisor of 2)" in heads, heads
        assert "LlamaForCausalLM's tensor-parallel plan names styles" in style, style
        assert "model.layers.0.input_layernorm: sequence_parallel" in style, style


def _made_before_initialize() -> list[dict]:
    """What a user makes from the model before ``initialize`` still trains it: a client optimizer built on its
    parameters, and ``model_parameters`` listed from them (DeepSpeed's API), 2 steps each on tensor 2 x data 1;
    then DeepSpeed's ``initialize`` with a config without tensor parallelism, in the same processes, gets plain data
    parallelism (not the groups left by the run before)."""
    out = []
    for how in ("optimizer", "model_parameters"):
        model = _model("llama")
        cfg = {k: v for k, v in _config(1).items() if not (how == "optimizer" and k == "optimizer")}
        if how == "optimizer":
            engine = zeroplus.initialize(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=LR,
                                                                              momentum=0.9))
        else:
            served, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
            engine = served.engine  # (zeroplus's engine inside DeepSpeed's)
        losses, _ = hf_steps(engine, _batches()[:2])
        out.append({"how": how, "losses": losses, "params": local_params(engine)})
        engine.destroy()
    plain = {k: v for k, v in _config(1).items() if k != "tensor_parallel"}  # next, in the same processes
    served, *_ = deepspeed.initialize(model=_model("llama"), config=plain)
    out.append({"how": "a config without tensor parallelism next", "layout": served.engine.parallel.topology.describe(),
                "split": any(isinstance(m, SPLIT) for m in served.module.modules())})
    served.destroy()
    return out


def test_an_optimizer_or_parameter_list_made_before_initialize_trains_the_slices():
    model, losses = _model("llama"), []
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for ids in _batches()[:2]:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip_global_norm(list(model.parameters()), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    dense = {n: p.detach() for n, p in model.named_parameters()}
    for rank, results in enumerate(run_distributed(_made_before_initialize, 2)):
        *results, plain = results  # (DeepSpeed's API: each initialize makes its config's groups)
        assert plain["layout"].startswith("2 ranks = data 2 x tensor 1") and not plain["split"], plain
        for got in results:
            label = f"{got['how']} made before initialize, rank {rank}"
            assert got["losses"] == pytest.approx(losses, rel=1e-5), label
            for name, value in got["params"].items():
                torch.testing.assert_close(value, _slice("llama", name, dense[name], rank), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name: f"{label}, {n}: {m}")
