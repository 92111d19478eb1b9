"""Hugging Face causal LMs keep no key/value cache while the engine trains them
(``zeroplus/activations/training_cache.py``): the same loss, no cache in training, the model's own
behaviour in evaluation and when the caller passes ``use_cache``."""
from __future__ import annotations

import copy

import pytest
import torch

import zeroplus
from tests import hf_models


def _cache_bytes(cache: object) -> int:
    return sum(t.numel() * t.element_size() for layer in getattr(cache, "layers") for t in (layer.keys, layer.values))


@pytest.mark.parametrize("family,tiled", [("llama", False), ("gpt2", False), ("llama", True)])
def test_training_forward_keeps_no_cache(family, tiled):
    torch.manual_seed(0)
    model = hf_models.build(family)
    plain = copy.deepcopy(model).train()
    engine = zeroplus.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
                                         "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
                                         "zeroplus": {"log_level": "warning", "memory_estimate": False,
                                                      **({"tiled": {"loss_tokens": 16}} if tiled else {})}})
    ids = torch.randint(0, 256, (2, 24))
    torch.manual_seed(1)  # (GPT-2's dropout draws alike in both)
    ref = plain(input_ids=ids, labels=ids)
    config = plain.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers, kv_width = config.num_hidden_layers, kv_heads * (config.hidden_size // config.num_attention_heads)
    assert _cache_bytes(ref.past_key_values) == 2 * layers * kv_width * 4 * ids.numel()  # what the default holds
    torch.manual_seed(1)
    out = engine(input_ids=ids, labels=ids)
    assert out.past_key_values is None
    if tiled:  # another summation order
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    else:
        assert torch.equal(out.loss, ref.loss)
    assert engine(input_ids=ids, labels=ids, use_cache=True).past_key_values is not None  # asked for: kept
    engine.eval()
    with torch.no_grad():
        assert engine(input_ids=ids).past_key_values is not None  # evaluation: the model's own default
    engine.destroy()
