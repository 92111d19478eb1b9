"""Hugging Face causal LMs built from a config (no weights downloaded): the five families the budget
and the memory techniques are verified on. ``build(family, size)``; sizes ``tiny`` (tests) and
``small`` (benchmarks)."""
from __future__ import annotations

from typing import Any

import torch
import transformers as tf

FAMILIES = ("llama", "gpt2", "qwen2", "mistral", "mixtral")
_DIMS = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 2, 4, 2, 256),
    "small": (512, 1408, 4, 8, 2, 32000),
}


def build(family: str, size: str = "tiny", attn: str = "sdpa", max_positions: int = 1024) -> torch.nn.Module:
    d, ff, layers, heads, kv, vocab = _DIMS[size]
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv,
                                  max_position_embeddings=max_positions, attn_implementation=attn)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "qwen3":  # (not in FAMILIES: the AutoTP test's; its head_dim is the hidden size's share)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=d // heads, **common))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=max_positions // 4, **common))
    if family == "mixtral":
        common["intermediate_size"] = ff // 2
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common))
    if family == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads,
                                                n_positions=max_positions, bos_token_id=0, eos_token_id=0,
                                                attn_implementation=attn))
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


class LossOf(torch.nn.Module):
    """``model(x, y)`` as ``tests/reference.py``'s loop calls it: the Hugging Face loss on ``labels=y``
    (names gain a ``model.`` prefix)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, labels=y).loss
