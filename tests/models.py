"""Small models for tests, built to hit the partitioning corner cases.

``ParityNet``: sizes not divisible by 2 or 4, a tied embedding / head (root unit), a frozen layer,
a parameter used twice in one forward (``blocks[i].gain``), parameters outside any repeated block
(``out_bias``), and a repeated block list (three units).
"""
from __future__ import annotations

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


def make_batches(num: int, micro_batch: int, seq: int = 8, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (micro_batch, seq), generator=g),
             torch.randint(0, VOCAB, (micro_batch, seq), generator=g)) for _ in range(num)]
