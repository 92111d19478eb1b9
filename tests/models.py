"""Small models for tests, built to hit the partitioning corner cases.

``ParityNet``: sizes not divisible by 2 or 4, a tied embedding / head (root unit), a frozen layer,
a parameter used twice in one forward (``blocks[i].gain``), parameters outside any repeated block
(``out_bias``), and a repeated block list (three units).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 37
DIM = 13


class ParityBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 3 * DIM - 2)
        self.down = nn.Linear(3 * DIM - 2, DIM)
        self.gain = nn.Parameter(torch.ones(DIM) * 0.9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x) * self.gain)))
        return x + h * self.gain  # gain used twice


class ParityNet(nn.Module):
    def __init__(self, n_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(ParityBlock() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.out_bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + 0.1 * self.frozen(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x) + self.out_bias
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def train_losses(engine: Any, *, hugging_face: bool, vocab: int, seq: int, seed: int, steps: int = 2) -> list[float]:
    """Train ``steps`` steps on random token ids of ``(1, seq)`` drawn from ``seed`` and return the losses: a
    Hugging Face model is called ``engine(input_ids=ids, labels=ids).loss``, any other ``engine(ids, ids)``."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, seq), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss if hugging_face else engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def make_batches(num: int, micro_batch: int, seq: int = 8, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (micro_batch, seq), generator=g),
             torch.randint(0, VOCAB, (micro_batch, seq), generator=g)) for _ in range(num)]


class GELUActivation(nn.Module):
    """As Hugging Face writes it: a module around the functional form (``transformers.activations``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class LlamaStyleMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: nn.Module) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaStyleAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        attn = torch.softmax(self.q_proj(h) @ h.transpose(-1, -2) / h.shape[-1] ** 0.5, dim=-1) @ h
        return self.o_proj(attn)


class LlamaStyleLayer(nn.Module):
    def __init__(self, dim: int, act: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim)
        self.self_attn = LlamaStyleAttention(dim)
        self.post_attention_layernorm = nn.RMSNorm(dim)
        self.mlp = LlamaStyleMLP(dim, 3 * dim, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStyleNet(nn.Module):
    """A Hugging Face Llama-shaped model: RMSNorm, SwiGLU MLP with ``nn.SiLU``, and one layer with a
    Hugging Face-style ``GELUActivation`` module instead."""

    def __init__(self, dim: int = 24, n_layers: int = 3) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, dim)
        acts = [nn.SiLU() for _ in range(n_layers - 1)] + [GELUActivation()]
        self.layers = nn.ModuleList(LlamaStyleLayer(dim, act) for act in acts)
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


# -- a GPT in plain PyTorch: its own Linear, LayerNorm and Embedding read ``self.weight`` in forward ----------
class PlainLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.t()
        return y + self.bias if self.bias is not None else y


class PlainLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class PlainEmbedding(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class PlainBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = PlainLayerNorm(d), PlainLayerNorm(d)
        self.qkv, self.proj = PlainLinear(d, 3 * d), PlainLinear(d, d)
        self.fc, self.out = PlainLinear(d, 4 * d), PlainLinear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    """A small GPT with no torch.nn layer classes: every module reads its ``self.weight`` itself."""

    def __init__(self, vocab: int = 256, d: int = 32, layers: int = 2, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = PlainEmbedding(vocab, d), PlainEmbedding(seq, d)
        self.blocks = nn.ModuleList(PlainBlock(d, heads) for _ in range(layers))
        self.ln, self.head = PlainLayerNorm(d), PlainLinear(d, vocab, bias=False)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(ids))


class SmallHeadNet(nn.Module):
    """A large untied embedding (with a padding index) and a small classifier head (8 classes)."""

    def __init__(self, vocab: int = 4096) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 64, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 8)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten() % 8)
