"""The built-in GPT in tensor-parallel form: the same model, its weights split over the tensor group.

Attention heads are split among the ``T`` ranks (``qkv`` column-parallel, each rank holding its heads'
rows of q, k and v; ``proj`` row-parallel), the MLP likewise (``fc`` column, ``proj`` row), the token
table along the vocabulary (tied to the LM head, whose logits stay split: the loss is the
vocab-parallel cross entropy). Norms, positions and the row-parallel biases are whole on every rank.
Mixture-of-experts MLPs (``moe_experts``) keep their experts whole: in the expert-data mode
(``experts_span_tensor``) the tensor ranks enlarge the expert group and each routes 1/T of the tokens
(``parallel/expert_tokens.py``).
Activations run ``(seq, batch, dim)``; with sequence parallelism they are split along the sequence
between the tensor-parallel regions (``(s/T, b, d)``: norms and residuals hold 1/T), and the
region boundaries become all-gather-then-matmul and matmul-then-reduce-scatter, chunked by
``overlap_chunks``. ``TensorParallelGPT.from_dense(gpt)`` takes a ``GPT``'s weights, so a run
starts from exactly the single-process model.

Memory per rank: 1/T of every attention and MLP weight and of the token table; activations inside
blocks 1/T of the heads and MLP width.
"""
from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..activations.checkpointing import checkpoint
from ..comm import DataParallelGroup
from ..parallel.expert_tokens import TokenSplit
from ..parallel.groups import parallel_groups
from ..parallel.mappings import copy_to_tensor, gather_last_dim, sum_grad_over_tensor
from ..parallel.overlap import all_gather_matmul
from ..parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelLayerNorm,
    VocabParallelEmbedding,
    mark_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from .gpt import GPT, MLP, Block, GPTConfig, MoEMLP


def _norm(dim: int, sequence_parallel: bool, tp: DataParallelGroup) -> nn.LayerNorm:
    return SequenceParallelLayerNorm(dim, tp=tp) if sequence_parallel else nn.LayerNorm(dim)


class TensorParallelAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: DataParallelGroup, sequence_parallel: bool, chunks: int) -> None:
        super().__init__()
        if cfg.n_head % tp.size:
            raise ValueError(f"GPT n_head = {cfg.n_head} does not split over a tensor-parallel group of {tp.size}")
        self.heads_per_rank, self.head_dim = cfg.n_head // tp.size, cfg.n_embd // cfg.n_head
        self.qkv = ColumnParallelLinear(cfg.n_embd, 3 * cfg.n_embd, sequence_parallel=sequence_parallel,
                                        overlap_chunks=chunks, tp=tp)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, sequence_parallel=sequence_parallel,
                                      overlap_chunks=chunks, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (s, b, 3 * d/T): this rank's heads
        s, b, _ = qkv.shape
        q, k, v = (z.view(s, b, self.heads_per_rank, self.head_dim).permute(1, 2, 0, 3)
                   for z in qkv.chunk(3, dim=-1))  # (b, heads/T, s, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))  # (s, b, d), or (s/T, b, d) sequence-parallel


class TensorParallelMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: DataParallelGroup, sequence_parallel: bool, chunks: int) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, sequence_parallel=sequence_parallel,
                                       overlap_chunks=chunks, tp=tp)
        self.act = nn.GELU()
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, sequence_parallel=sequence_parallel,
                                      overlap_chunks=chunks, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class TensorParallelBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: DataParallelGroup, sequence_parallel: bool, chunks: int) -> None:
        super().__init__()
        self.ln1 = _norm(cfg.n_embd, sequence_parallel, tp)
        self.attn = TensorParallelAttention(cfg, tp, sequence_parallel, chunks)
        self.ln2 = _norm(cfg.n_embd, sequence_parallel, tp)
        self.mlp: nn.Module = (_experts(cfg, tp, sequence_parallel) if cfg.moe_experts
                               else TensorParallelMLP(cfg, tp, sequence_parallel, chunks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _experts(cfg: GPTConfig, tp: DataParallelGroup, sequence_parallel: bool) -> MoEMLP:
    """The block's mixture of experts beside tensor-parallel attention: whole experts. In the expert-data mode
    (``experts_span_tensor``) the expert group spans the tensor ranks and each routes 1/T of the tokens (under
    sequence parallelism its own part); otherwise every tensor rank runs the same experts on the same tokens
    (replicated), which sequence parallelism cannot do (its ranks hold different tokens): refused."""
    groups = parallel_groups()
    span = groups.topology.experts_span_tensor
    if tp.size > 1 and sequence_parallel and not span:
        raise ValueError(f"a mixture of experts beside tensor size {tp.size} with sequence parallelism needs "
                         f"zeroplus.parallel.experts_span_tensor (the expert-data mode): the tensor ranks hold "
                         f"different tokens, so each must route its own")
    return MoEMLP(cfg, groups.expert, TokenSplit(tp if span else None, presplit=sequence_parallel))


class TensorParallelGPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, sequence_parallel: bool = False, overlap_chunks: int = 1,
                 tp: DataParallelGroup | None = None) -> None:
        super().__init__()
        if cfg.dropout:
            raise ValueError("TensorParallelGPT has no dropout yet (it needs a random state per tensor rank); "
                             f"got dropout {cfg.dropout}")
        self.config, self.tp = cfg, tp if tp is not None else parallel_groups().tensor
        self.sequence_parallel, self.overlap_chunks = sequence_parallel, overlap_chunks
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, sequence_parallel=sequence_parallel,
                                          tp=self.tp)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(TensorParallelBlock(cfg, self.tp, sequence_parallel, overlap_chunks)
                                    for _ in range(cfg.n_layer))
        self.ln_f = _norm(cfg.n_embd, sequence_parallel, self.tp)

    @classmethod
    def from_dense(cls, gpt: GPT, *, sequence_parallel: bool = False, overlap_chunks: int = 1,
                   tp: DataParallelGroup | None = None) -> TensorParallelGPT:
        """This rank's slices of ``gpt``'s weights (heads, MLP width and vocabulary split)."""
        model = cls(gpt.config, sequence_parallel=sequence_parallel, overlap_chunks=overlap_chunks, tp=tp)
        d, T = gpt.config.n_embd, model.tp.size
        with torch.no_grad():
            model.wte.load_dense(gpt.wte.weight)
            model.wpe.weight.copy_(gpt.wpe.weight)
            model.ln_f.load_state_dict(gpt.ln_f.state_dict())
            pairs = zip(cast("list[TensorParallelBlock]", list(model.blocks)), cast("list[Block]", list(gpt.blocks)))
            for mine, dense in pairs:
                mine.ln1.load_state_dict(dense.ln1.state_dict())
                mine.ln2.load_state_dict(dense.ln2.state_dict())
                # rank t's rows of q, k and v, next to each other, so a plain row split gives them to it
                w = torch.cat([torch.cat([z.chunk(T, 0)[t] for z in dense.attn.qkv.weight.split(d, 0)])
                               for t in range(T)])
                b = torch.cat([torch.cat([z.chunk(T, 0)[t] for z in dense.attn.qkv.bias.split(d, 0)])
                               for t in range(T)])
                mine.attn.qkv.load_dense(w, b)
                mine.attn.proj.load_dense(dense.attn.proj.weight, dense.attn.proj.bias)
                if isinstance(mine.mlp, MoEMLP):
                    _load_experts(mine.mlp, cast(MoEMLP, dense.mlp))
                    continue
                mlp, tp_mlp = cast(MLP, dense.mlp), cast(TensorParallelMLP, mine.mlp)
                tp_mlp.fc.load_dense(mlp.fc.weight, mlp.fc.bias)
                tp_mlp.proj.load_dense(mlp.proj.weight, mlp.proj.bias)
        return model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` (gathered), or the mean cross entropy if ``targets`` is given."""
        b, t = idx.shape
        x = embed(self, idx)  # (t, b, d), or (t/T, b, d) sequence-parallel
        replay = self.config.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x) if replay else block(x)
        x = self.ln_f(x)
        if self.sequence_parallel:  # the LM head is column-parallel over the vocabulary, tied to the table
            logits = all_gather_matmul(x, self.wte.weight, None, self.tp, self.overlap_chunks)
        else:
            logits = F.linear(copy_to_tensor(x, self.tp), self.wte.weight)  # (t, b, V/T)
        if targets is None:
            return gather_last_dim(logits, self.tp).transpose(0, 1)
        losses = vocab_parallel_cross_entropy(logits.reshape(t * b, -1), targets.t().reshape(-1), self.wte.start,
                                              self.tp)
        return losses.mean()


def _load_experts(mine: MoEMLP, dense: MoEMLP) -> None:
    """The router and this rank's experts (by their global index) from a mixture holding every expert, or
    holding this rank's experts already (built under the same expert group)."""
    mine.moe.gate.load_state_dict(dense.moe.gate.state_dict())
    if (dense.moe.local, dense.moe.first_expert) == (mine.moe.local, mine.moe.first_expert):
        mine.moe.experts.load_state_dict(dense.moe.experts.state_dict())
        return
    if dense.moe.local != dense.moe.num_experts:
        raise ValueError(f"from_dense takes a GPT holding all {dense.moe.num_experts} experts of each block, or "
                         f"this rank's {mine.moe.local} from expert {mine.moe.first_expert}; this one holds "
                         f"{dense.moe.local} from expert {dense.moe.first_expert}")
    full = dense.moe.experts.state_dict()
    first, local = mine.moe.first_expert, mine.moe.local
    if mine.moe.grouped:  # stacked: this rank's rows of every stacked weight
        mine.moe.experts.load_state_dict({n: v[first:first + local] for n, v in full.items()})
        return
    mine.moe.experts.load_state_dict({f"{int(n.split('.', 1)[0]) - first}.{n.split('.', 1)[1]}": v
                                      for n, v in full.items() if first <= int(n.split(".", 1)[0]) < first + local})


def embed(owner: Any, idx: torch.Tensor) -> torch.Tensor:
    """Token and position embeddings of ``idx`` (b, t) as ``(t, b, d)``; with sequence parallelism this rank's
    ``(t/T, b, d)``: the token table's partial sums are reduce-scattered, and the positions looked up for this
    slice only (their table's gradient is then summed over the tensor group)."""
    t = idx.shape[1]
    pos = torch.arange(t, device=idx.device)
    if not owner.sequence_parallel:
        return owner.wte(idx.t()) + owner.wpe(pos).unsqueeze(1)
    if t % owner.tp.size:
        raise ValueError(f"sequence parallelism on tensor rank {owner.tp.rank}: sequence length {t} does not split "
                         f"into {owner.tp.size} equal parts")
    per = t // owner.tp.size
    mine = pos[owner.tp.rank * per:(owner.tp.rank + 1) * per]
    return owner.wte(idx.t()) + F.embedding(mine, sum_grad_over_tensor(owner.wpe.weight, owner.tp)).unsqueeze(1)


class TensorParallelEmbedding(nn.Module):
    """Pipeline layer 0 of the tensor-parallel GPT: ids ``(b, t)`` -> ``(t, b, d)`` (``(t/T, b, d)`` with
    sequence parallelism)."""

    def __init__(self, gpt: TensorParallelGPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.tp, self.sequence_parallel = gpt.wte, gpt.wpe, gpt.tp, gpt.sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return embed(self, idx)


class TensorParallelHead(nn.Module):
    """The last pipeline layer: final norm and this rank's vocabulary slice of the logits ``(t, b, V/T)``.
    Its weight starts as a copy of the token table's slice (the table sits on the first stage)."""

    def __init__(self, gpt: TensorParallelGPT) -> None:
        super().__init__()
        self.ln_f, self.tp = gpt.ln_f, gpt.tp
        self.sequence_parallel, self.overlap_chunks = gpt.sequence_parallel, gpt.overlap_chunks
        self.weight = mark_tensor_parallel(nn.Parameter(gpt.wte.weight.detach().clone()))  # (V/T, d)
        self.start = gpt.wte.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_f(x)
        if self.sequence_parallel:
            return all_gather_matmul(x, self.weight, None, self.tp, self.overlap_chunks)
        return F.linear(copy_to_tensor(x, self.tp), self.weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of ``logits`` (t, b, V/T) against ``targets`` (b, t)."""
        t, b = logits.shape[:2]
        return vocab_parallel_cross_entropy(logits.reshape(t * b, -1), targets.t().reshape(-1), self.start,
                                            self.tp).mean()


def tensor_parallel_pipeline_layers(gpt: TensorParallelGPT) -> tuple[list[nn.Module], Any]:
    """``(layers, loss_fn)`` for ``PipelineModule``: embeddings, blocks, norm and head, tensor-parallel inside
    each (data x tensor x pipeline). The head is untied from the token table, as in ``gpt_pipeline_layers``."""
    head = TensorParallelHead(gpt)
    return [TensorParallelEmbedding(gpt), *gpt.blocks, head], head.loss


__all__ = ["TensorParallelGPT", "tensor_parallel_pipeline_layers"]
