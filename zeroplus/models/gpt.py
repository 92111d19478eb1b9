"""A small GPT (byte-level by default: vocab 256, no tokenizer) for the main job, tests and benchmarks.

Pre-norm transformer blocks in an ``nn.ModuleList`` (so each block becomes one ZeRO unit), the
token embedding tied to the LM head (a tied weight in the root unit), learned positions.
Parameters: about ``12 * n_layer * d^2 + (vocab + seq) * d``. With ``moe_experts = X`` every block's
MLP is a mixture of X such MLPs (``zeroplus.parallel.MoE``, top-``moe_k``), ``8 * d^2 * X`` parameters
per block instead of ``8 * d^2``, split over the expert-parallel group (X / E per rank); each layer's
load-balancing loss, times ``moe_aux_coef``, enters the gradient without changing the returned loss.
``moe_grouped``: the same experts held as stacked weights (``parallel/grouped_experts.py``), one batched
product per projection for all of a rank's experts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..activations.checkpointing import checkpoint
from ..activations.tiled import tiled_cross_entropy
from ..comm import DataParallelGroup
from ..parallel.context import check_heads, local_slice, positions, seq_to_heads
from ..parallel.expert_tokens import TokenSplit
from ..parallel.grouped_experts import GroupedFFN
from ..parallel.groups import SingleRank, current_groups
from ..parallel.moe import MoE, with_aux_loss
from ..parallel.ring_attention import ring_attention, zigzag_positions, zigzag_slice
from ..parallel.ulysses_output import output_exchanged


@dataclasses.dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    checkpoint_blocks: bool = False  # activation checkpointing of every block (zeroplus.checkpointing)
    moe_experts: int = 0  # > 0: each block's MLP is a mixture of this many experts
    moe_k: int = 1
    moe_capacity_factor: float = 1.25
    moe_aux_coef: float = 0.01
    moe_grouped: bool = False  # the experts as stacked weights, one batched product per projection
    loss_tile_tokens: int = 0  # > 0: the LM head and cross-entropy run over this many tokens at a time
    tie_head: bool = True  # False: the LM head has a weight of its own (vocabulary x n_embd more parameters)

    @property
    def hidden_size(self) -> int:
        return self.n_embd


_SIZES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),
    "small": dict(n_layer=4, n_head=4, n_embd=128),
    "medium": dict(n_layer=6, n_head=6, n_embd=384),
    "28m": dict(n_layer=12, n_head=6, n_embd=384, vocab_size=16384, block_size=1024),  # activations dominate
    "111m": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=32000, block_size=1024),
}


def gpt_config(size: str, **overrides: Any) -> GPTConfig:
    if size not in _SIZES:
        raise ValueError(f"unknown GPT size {size!r}; choose one of {sorted(_SIZES)}")
    return GPTConfig(**{**_SIZES[size], **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (batch, seq, d); under context parallelism this rank's 1/C of the sequence
        cp = context_group()
        if cp.size > 1 and context_mode() == "hybrid":  # heads over the Ulysses group, K/V around the ring
            ug, rg = hybrid_groups()
            q, k, v = self.qkv(x).split(c, dim=2)
            q, k, v = (seq_to_heads(z.view(b, t, self.n_head, c // self.n_head), ug).transpose(1, 2)
                       for z in (q, k, v))  # (b, heads / U, t U: the ring rank's zigzag tokens, d/heads)

            def ring() -> tuple[torch.Tensor, None]:  # (b, t U, heads / U, d/heads), in the ring's output memory
                return ring_attention(q, k, v, rg).transpose(1, 2), None
            y, _ = output_exchanged(ug, ring)  # brought home, the ring's saved output formed again from it
            return self.proj(y.reshape(b, t, c))
        if cp.size > 1 and context_mode() == "ring":  # this rank's zigzag tokens, keys and values around the ring
            # Q, K and V each in its own (b, t, heads, d/heads) memory, which the ring sends as it is: without
            # this, K and V (views into the fused projection's rows) were copied before every transfer
            q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 1, 3, 4).contiguous()
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            return self.proj(ring_attention(q, k, v, cp).transpose(1, 2).reshape(b, t, c))
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (seq_to_heads(z.view(b, t, self.n_head, c // self.n_head), cp).transpose(1, 2) for z in (q, k, v))

        def attend() -> tuple[torch.Tensor, None]:  # (b, whole seq, heads / C, d/heads)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2), None
        y, _ = output_exchanged(cp, attend)  # brought home: (b, seq / C, heads, d/heads)
        return self.proj(y.reshape(b, t, c))


def context_group() -> DataParallelGroup:
    """The context-parallel group of the groups made so far (``zeroplus/parallel/context.py``; one rank if none)."""
    groups = current_groups()
    return groups.context if groups is not None else _ONE_RANK


def context_mode() -> str:
    groups = current_groups()
    return groups.context_mode if groups is not None else "ulysses"


def hybrid_groups() -> tuple[DataParallelGroup, DataParallelGroup]:
    """``context_mode: "hybrid"``: the Ulysses group (heads) and the ring (K/V) of this rank."""
    groups = current_groups()
    return (groups.context_ulysses, groups.context_ring) if groups is not None else (_ONE_RANK, _ONE_RANK)


_ONE_RANK = SingleRank()  # (not DataParallelGroup(None): made after a launch, that is the whole world)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class MoEMLP(nn.Module):
    """The MLP as a mixture of experts (each one ``MLP``); its balancing loss joins the backward."""

    def __init__(self, cfg: GPTConfig, expert_group: Any = None, split: TokenSplit | None = None) -> None:
        """``split``: how tokens are shared with the tensor group (``parallel/expert_tokens.py``; default: the
        topology's)."""
        super().__init__()
        expert = GroupedFFN(4 * cfg.n_embd, "gelu", bias=True) if cfg.moe_grouped else (lambda: MLP(cfg))
        self.moe = MoE(cfg.n_embd, expert, cfg.moe_experts, k=cfg.moe_k,
                       capacity_factor=cfg.moe_capacity_factor, ep=expert_group, split=split)
        self.aux_coef = cfg.moe_aux_coef
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.moe(x)
        self.last_aux_loss = aux.detach()
        return with_aux_loss(y, aux * self.aux_coef)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, expert_group: Any = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = MoEMLP(cfg, expert_group) if cfg.moe_experts else MLP(cfg)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class GPT(nn.Module):
    # a capability the engine reads (engine/build.py): under context parallelism this model keeps its own 1/C of
    # every sequence (its attention exchanges the rest), so the engine wraps nothing
    splits_own_sequences = True

    def __init__(self, cfg: GPTConfig, expert_group: Any = None) -> None:
        """``expert_group``: the expert-parallel group for MoE blocks (default: ``parallel_groups().expert``;
        a group of one rank holds every expert)."""
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, expert_group) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_head:
            self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``, or the mean cross-entropy if ``targets`` is given. Under context
        parallelism (C ranks) every rank of a context group gets the same whole sequences and keeps its
        contiguous 1/C (positions stay global): the logits are of those tokens, the loss their mean."""
        cp = context_group()
        mode = context_mode() if cp.size > 1 else "ulysses"
        if mode == "hybrid":  # the ring rank's zigzag chunks, then this rank's contiguous 1/U of them
            ug, rg = hybrid_groups()
            check_heads(self.config.n_head, ug)
            idx = local_slice(zigzag_slice(idx, rg), ug)
            targets = local_slice(zigzag_slice(targets, rg), ug) if targets is not None else None
            b, t = idx.shape
            pos = local_slice(zigzag_positions(t * ug.size, rg, idx.device), ug, dim=0)
        else:
            ring = mode == "ring"
            split = zigzag_slice if ring else local_slice  # ring: chunks c and 2C-1-c of 2C (balanced causal work)
            if cp.size > 1 and not ring:
                check_heads(self.config.n_head, cp)
            idx = split(idx, cp)
            targets = split(targets, cp) if targets is not None else None
            b, t = idx.shape
            pos = zigzag_positions(t, cp, idx.device) if ring else positions(t, cp, idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (b, t, d)
        replay = self.config.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x) if replay else block(x)
        if targets is not None and self.config.loss_tile_tokens > 0:  # never the whole (b, t, vocab) logits
            return tiled_cross_entropy(self.lm_head, self.ln_f(x), targets, self.config.loss_tile_tokens)
        logits = self.lm_head(self.ln_f(x))  # (b, t, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
