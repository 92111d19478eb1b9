"""Config validation: every bad input gives the promised message; DeepSpeed's real-config habits pass."""
from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch

import zeroplus
from zeroplus.config import ConfigError, parse_config, resolve_auto, resolve_batch
from zeroplus.models import GPT, gpt_config
from zeroplus.source_tree import configs_dir

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)


def _resolved(raw: dict, dp: int = 1, model: torch.nn.Module | None = None):
    cfg, unimplemented = parse_config(raw)
    resolve_batch(cfg, dp)
    resolve_auto(cfg, model or GPT(gpt_config("tiny")), has_client_optimizer=False)
    return cfg, unimplemented


def test_misspelt_top_level_key_is_an_error_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown config key 'gradient_clippping'.*did you mean 'gradient_clipping'"):
        parse_config({"train_batch_size": 8, "gradient_clippping": 1.0})


def test_misspelt_nested_key_names_its_path():
    with pytest.raises(ConfigError, match=r"'zero_optimization.reduce_bucket_sise'.*did you mean "
                                          r"'zero_optimization.reduce_bucket_size'"):
        parse_config({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}})
    with pytest.raises(ConfigError, match=r"'zero_optimization.offload_optimizer.devcie'.*did you mean "
                                          r"'zero_optimization.offload_optimizer.device'"):
        parse_config({"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}})


def test_unimplemented_deepspeed_keys_are_collected_not_fatal():
    _, unimplemented = parse_config({"train_batch_size": 8, "eigenvalue": {"enabled": False},
                                     "zero_optimization": {"stage": 1, "round_robin_gradients": True}})
    assert unimplemented == ["eigenvalue", "zero_optimization.round_robin_gradients"]


def test_wrong_type_and_range_name_key_and_value():
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage'.*less than or equal to 3.*got 4"):
        parse_config({"zero_optimization": {"stage": 4}})
    with pytest.raises(ConfigError, match=r"'fp16.hysteresis'.*got 'two'"):
        parse_config({"fp16": {"hysteresis": "two"}})


def test_integral_floats_are_accepted_for_integer_fields():
    cfg, _ = parse_config({"zero_optimization": {"reduce_bucket_size": 2e8, "sub_group_size": 1e9}})
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert cfg.zero_optimization.sub_group_size == 1_000_000_000


def test_dotted_keys_are_the_nested_keys_they_name(caplog):
    """TRL adds its reference model's bucket sizes as dotted top-level keys (fractional for the prefetch
    bucket); DeepSpeed ignores them, zeroplus refused them as unknown keys before: they are read as the
    nested keys they name, a fractional element count as the whole elements below it."""
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
           "zero_optimization.reduce_bucket_size": 1024, "zero_optimization.stage3_prefetch_bucket_size": 921.6,
           "zero_optimization.stage3_param_persistence_threshold": 320}
    with caplog.at_level(logging.INFO, logger="zeroplus.config"):
        cfg, _ = parse_config(raw)
    zero = cfg.zero_optimization
    assert (zero.stage, zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
            zero.stage3_param_persistence_threshold) == (3, 1024, 921, 320)
    assert "'zero_optimization.reduce_bucket_size' given as a dotted key (1024) replaces 'auto'" in caplog.text
    assert "zero_optimization.reduce_bucket_size" in raw, "the caller's dict is not changed"
    cfg, _ = parse_config({"bf16.enabled": True, "zero_optimization": {"offload_param.device": "cpu"}})
    assert cfg.bf16.enabled is True and cfg.zero_optimization.offload_param.device == "cpu"
    with pytest.raises(ConfigError, match=r"unknown config key 'zero_optimization.reduce_bucket_sise'.*did you "
                                          r"mean 'zero_optimization.reduce_bucket_size'"):
        parse_config({"zero_optimization.reduce_bucket_sise": 3})
    with pytest.raises(ConfigError, match=r"'fp16.enabled' \(value True\) names a key inside 'fp16', which is True"):
        parse_config({"fp16": True, "fp16.enabled": True})


@pytest.mark.parametrize("raw,dp,expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 16}, 4, (16, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 2}, 3, (6, 2, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"},
     2, (4, 2, 1)),
])
def test_batch_triple_is_derived(raw, dp, expected):
    cfg, _ = _resolved(raw, dp)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_inconsistent_batch_triple_shows_all_four_numbers():
    with pytest.raises(ConfigError, match=r"train_batch_size \(30\).*micro_batch_size_per_gpu \(4\).*"
                                          r"gradient_accumulation_steps \(2\).*data-parallel size \(4\)"):
        _resolved({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4)


def test_auto_values_are_resolved_and_logged(caplog):
    model = GPT(gpt_config("tiny"))  # hidden size 64
    raw = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto", "eps": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min_lr": "auto",
                                                        "warmup_num_steps": 10}}}
    with caplog.at_level(logging.INFO, logger="zeroplus.config"):
        cfg, _ = _resolved(raw, 1, model)
    zero = cfg.zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold) == \
        (64 * 64, int(0.9 * 64 * 64), 640)
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False  # fp32 model: never "auto" -> true
    assert "betas" not in cfg.optimizer.params and cfg.scheduler.params["warmup_max_lr"] == 1e-3
    assert "reduce_bucket_size 'auto' = 4096" in caplog.text


def test_auto_precision_follows_model_dtype():
    cfg, _ = _resolved({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": "auto"}}, 1,
                       GPT(gpt_config("tiny")).to(torch.bfloat16))
    assert cfg.bf16.enabled is True


def test_underivable_auto_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"'optimizer.params.lr' is 'auto'"):
        _resolved({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    with pytest.raises(ConfigError, match=r"'gradient_clipping' is 'auto'"):
        _resolved({"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "auto"})


def test_config_from_json_path_and_bad_paths(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2}}))
    cfg, _ = parse_config(str(path))
    assert cfg.zero_optimization.stage == 2
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_config(str(bad))


def test_initialize_rejects_bad_optimizer_params_and_both_precisions():
    base = {"train_micro_batch_size_per_gpu": 1, "zeroplus": {"log_level": "error"}}
    with pytest.raises(ValueError, match=r"'optimizer.params.weight_decya'.*did you mean 'weight_decay'"):
        zeroplus.initialize(GPT(gpt_config("tiny")), {**base, "optimizer": {"type": "AdamW",
                                                                           "params": {"weight_decya": 0.1}}})
    with pytest.raises(ConfigError, match="both fp16 and bf16"):
        zeroplus.initialize(GPT(gpt_config("tiny")), {**base, "fp16": {"enabled": True}, "bf16": {"enabled": True},
                                                      "optimizer": {"type": "AdamW", "params": {}}})
    with pytest.raises(ValueError, match="optimizer.type 'Adamax2' is not supported"):
        zeroplus.initialize(GPT(gpt_config("tiny")), {**base, "optimizer": {"type": "Adamax2", "params": {}}})
    with pytest.raises(ConfigError, match="config has a 'scheduler' but no 'optimizer' block"):
        zeroplus.initialize(GPT(gpt_config("tiny")), {**base, "scheduler": {"type": "WarmupLR", "params": {}}})


def test_example_configs_parse():
    import pathlib
    configs = sorted(pathlib.Path(configs_dir()).glob("*.json"))
    assert len(configs) >= 6
    for path in configs:
        cfg, unimplemented = parse_config(str(path))
        assert not unimplemented, path


def test_deepspeed_tensor_parallel_size_is_the_tensor_size():
    cfg, unimplemented = parse_config({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}})
    assert cfg.zeroplus.parallel.tensor == 2 and unimplemented == ["tensor_parallel.tp_overlap_comm"]
    assert parse_config({"zeroplus": {"parallel": {"tensor": 2}}})[0].tensor_parallel.autotp_size == 2
    with pytest.raises(ConfigError, match=r"'tensor_parallel.autotp_size' \(2\) and 'zeroplus.parallel.tensor' \(4\)"):
        parse_config({"tensor_parallel": {"autotp_size": 2}, "zeroplus": {"parallel": {"tensor": 4}}})


def test_resolved_config_has_no_auto_and_names_what_is_left():
    """After resolution the layers below the top get a ResolvedConfig: plain values in every field that could
    say 'auto'; a key left 'auto' (or an unset batch triple) is an error naming it."""
    from zeroplus.config import ResolvedConfig, resolved
    cfg, _ = parse_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                           "zeroplus": {"shared_master_weights": "auto"}})
    with pytest.raises(ConfigError, match=r"\['zeroplus.shared_master_weights', 'train_batch_size', "
                                          r"'gradient_accumulation_steps'\]"):
        resolved(cfg)
    cfg.zeroplus.shared_master_weights = False
    resolve_batch(cfg, 4)
    out = resolved(cfg)
    assert isinstance(out, ResolvedConfig) and resolved(out) is out
    assert (out.train_batch_size, out.gradient_accumulation_steps, out.zero_optimization.stage) == (8, 1, 2)
    recompute = out.zeroplus.resize_recompute  # unset: on by default (see note: recompute by default)
    assert (recompute.enabled, recompute.by_default) == (True, True)
    cfg.zeroplus.resize_recompute.enabled = True
    assert out.model_dump(exclude={"zeroplus": {"resize_recompute": {"by_default"}}}) == cfg.model_dump()


def test_every_unknown_key_is_listed_at_once():
    with pytest.raises(ConfigError) as err:
        parse_config({"gradient_clippping": 1.0, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5},
                      "train_batch_size": 8})
    message = str(err.value)
    assert message.startswith("2 unknown config keys")
    assert "'gradient_clippping' (value 1.0) at the top level; did you mean 'gradient_clipping'?" in message
    assert "'zero_optimization.reduce_bucket_sise' (value 5) at 'zero_optimization'; did you mean " \
           "'zero_optimization.reduce_bucket_size'?" in message


def test_a_hugging_face_template_as_it_is_names_every_auto_key_and_who_fills_them():
    import pathlib
    path = pathlib.Path(configs_dir()) / "hf_zero3_template.json"
    with pytest.raises(ConfigError) as err:
        zeroplus.initialize(GPT(gpt_config("tiny")), str(path))
    message = str(err.value)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "optimizer.params.lr", "scheduler.params.warmup_max_lr",
                "scheduler.params.warmup_num_steps"):
        assert f"'{key}'" in message, key
    for derivable in ("warmup_min_lr", "reduce_bucket_size", "betas", "fp16.enabled"):
        assert derivable not in message, derivable
    assert "the Trainer" in message and "zeroplus run --deepspeed-api" in message
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage': the planner fills these within "
                                          r"'zeroplus.memory_budget'"):
        zeroplus.initialize(GPT(gpt_config("tiny")), {"train_micro_batch_size_per_gpu": 1,
                                                      "zero_optimization": {"stage": "auto"}})


def test_bf16_on_a_cpu_that_emulates_it_is_warned_once(caplog):
    """The real CPU decides: on one without avx512_bf16/AMX the warning names the measured slowdown."""
    from zeroplus.cpu_precision import native_bf16, warn_if_bf16_is_emulated
    from zeroplus.train_job import default_config_path
    warn_if_bf16_is_emulated.cache_clear()
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    log = logging.getLogger("zeroplus")  # (it does not propagate: its own handler prints the rank)
    log.addHandler(caplog.handler)
    try:
        zeroplus.initialize(GPT(gpt_config("tiny")), {**base, "bf16": {"enabled": True}})
        zeroplus.initialize(GPT(gpt_config("tiny")), {**base, "bf16": {"enabled": True}})
    finally:
        log.removeHandler(caplog.handler)
    emulated = [r.getMessage() for r in caplog.records if "bf16 compute is emulated" in r.getMessage()]
    assert len(emulated) == (0 if native_bf16() else 1), emulated
    assert default_config_path().endswith("zero3_bf16.json" if native_bf16() else "zero3_fp32.json")
    if emulated:
        assert "x as long as an fp32 one here" in emulated[0]


def test_resize_recompute_left_unset_is_on_where_it_can_run():
    """``zeroplus.resize_recompute.enabled`` unset (see note: recompute by default): on, with the norms; off for a
    compiled model and for pipeline stages; with a memory budget the planner's, which then weighs both (and only
    off beside pipelines, which refuse it). Written out, it keeps its value."""
    from zeroplus.budget.planner import _candidates

    model = GPT(gpt_config("tiny"))

    def resolved_value(zp: dict, **kwargs) -> object:
        cfg, _ = parse_config({"train_micro_batch_size_per_gpu": 2, "zeroplus": zp})
        resolve_auto(cfg, model, False, **kwargs)
        return cfg.zeroplus.resize_recompute.enabled

    assert parse_config({})[0].zeroplus.resize_recompute.norms is True
    assert resolved_value({}) is True
    assert resolved_value({}, compiled=True) is False
    assert resolved_value({"parallel": {"pipeline": 2}}) is False
    assert resolved_value({}, planned=True) == "auto"
    assert resolved_value({"resize_recompute": {"enabled": False}}) is False
    assert resolved_value({"resize_recompute": {"enabled": True}}, compiled=True) is True  # refused where it runs

    def recompute_candidates(zp: dict) -> set:
        cfg, _ = parse_config({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                               "zeroplus": {"memory_budget": "1GB", **zp}})
        return {s.recompute for s in _candidates(cfg)}

    assert recompute_candidates({}) == {False, True}
    assert recompute_candidates({"parallel": {"pipeline": 2}}) == {False}
    assert recompute_candidates({"resize_recompute": {"enabled": False}}) == {False}


@pytest.mark.parametrize("classes", ["nn", "own"])
def test_auto_bucket_sizes_read_the_width_whatever_the_layer_classes(classes):
    """A model without a config (the user's GPT, width 512) gives its width to the 'auto' bucket sizes from what its
    parameters are, written with torch.nn's layers or with its own: not from a layer class (the old rule read
    nn.LayerNorm, then the largest nn.Linear input: 4 x 512 for a model of linears alone)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "bench"))
    from bench_harness import user_gpt
    with torch.device("meta"):
        model = user_gpt(classes, 64, "test")
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}
    zero = _resolved(raw, 1, model)[0].zero_optimization
    assert (zero.reduce_bucket_size, zero.stage3_param_persistence_threshold) == (512 * 512, 5120)
