"""The built-in GPT as a list of pipeline layers: the embeddings, each block, the final norm and head.

``gpt_pipeline_layers(gpt)`` shares ``gpt``'s modules (no copy), except the LM head when it is tied to
the token table: the head sits on the last stage and the table on the first, so the head takes a
copy of the table and trains on its own from there (keeping them tied across stages, with an
all-reduce of their gradients between the first and last stage, is not built yet).
``gpt_pipeline_loss(logits, targets)`` is ``GPT``'s own loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT


class GPTEmbedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (b, t, d)


class GPTHead(nn.Module):
    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (b, t, vocab)


def untie_head(gpt: GPT) -> GPT:
    """Give ``gpt``'s LM head its own copy of the token table (what a pipeline of 2+ stages trains)."""
    if gpt.lm_head.weight is gpt.wte.weight:
        gpt.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())
    return gpt


def gpt_pipeline_layers(gpt: GPT) -> list[nn.Module]:
    untie_head(gpt)
    return [GPTEmbedding(gpt.wte, gpt.wpe), *gpt.blocks, GPTHead(gpt.ln_f, gpt.lm_head)]


def gpt_pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


__all__ = ["GPTEmbedding", "GPTHead", "gpt_pipeline_layers", "gpt_pipeline_loss", "untie_head"]
