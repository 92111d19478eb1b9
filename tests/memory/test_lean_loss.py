"""The lean loss (``zeroplus.lean_cross_entropy``, on by default): the model's own ``F.cross_entropy`` by blocks.

Training: a model whose forward ends in ``F.cross_entropy`` over its flattened logits and a Hugging Face Llama
(its ``ForCausalLMLoss``) on 2 ranks at stages 0 and 3, fp32 and bf16, two micro-batches per step: the losses
and every reduced gradient equal the run with the key off bit for bit, and the mode took one call per
forward; a call it does not compute (label smoothing) runs as written and is not taken. Memory: the bytes
created in the loss's backward are one logits' worth fewer (a dispatch mode over every storage), and the
first forward's census counts the logits the loss keeps as saved even when the model returns them. Logits that
fit one block of rows are left to torch (the blocked loss would hold one logits' worth more in backward): the
mode takes no call and stands aside after the first forward.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.hf_models import build
from tests.models import make_batches
from tests.saved_bytes import PeakOfNewStorages
from zeroplus.kernels import cross_entropy_rows as rows_kernel
from zeroplus.kernels.cross_entropy_rows import block_rows, cross_entropy_rows

VOCAB = 512


class _Net(nn.Module):
    """Two blocks and a head; the loss in the forward, as a user writes it."""

    def __init__(self, d: int = 16, smoothing: float = 0.0, vocab: int = VOCAB) -> None:
        super().__init__()
        self.smoothing = smoothing
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU()) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.flatten(), label_smoothing=self.smoothing)


def _config(stage: int, dtype: str, lean: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": dtype == "bf16"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "lean_cross_entropy": lean}}


SMALL_BLOCKS = 4096  # elements a block: these logits (48 x 512, 46 x 256) span several blocks, as a real LM's do
CPU_BLOCKS = rows_kernel.BLOCK_ELEMENTS  # the kernel's own (2^19)


def _train(kind: str, stage: int, dtype: str, lean: bool, block_elements: int = SMALL_BLOCKS) -> dict:
    rows_kernel.BLOCK_ELEMENTS = block_elements  # (this worker process only)
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = build("llama", "tiny") if kind == "llama" else _Net(smoothing=0.1 if kind == "smoothing" else 0.0)
    engine = zeroplus.initialize(model, _config(stage, dtype, lean))
    batches = [(x % 256, y % 256) for x, y in make_batches(4 * world, 2, seq=24)]
    out: dict = {"losses": [], "grads": [], "taken": 0}
    for i in range(4):  # two steps of two micro-batches
        x, y = batches[i * world + rank]
        loss = engine(input_ids=x, labels=y).loss if kind == "llama" else engine(x, y)
        engine.backward(loss)
        out["losses"].append(loss.item())
        if i % 2:  # the boundary: the reduced gradients, before the step
            groups = engine.partition.groups
            out["grads"].append([(g.gradient.flat if stage == 0 else g.gradient.reduced).clone() for g in groups])
        engine.step()
    out["taken"] = sum(m.taken for m in engine.activations.around)
    out["idle"] = [m.idle for m in engine.activations.around]
    engine.destroy()
    return out


def _job(kind: str) -> list:
    return [(_train(kind, s, d, False), _train(kind, s, d, True)) for s in (0, 3) for d in ("fp32", "bf16")]


@pytest.mark.parametrize("kind", ["net", "llama", "smoothing"])
def test_training_with_the_lean_loss_is_bitwise_torchs(kind):
    results = run_distributed(_job, 2, kind)[0]
    for (stage, dtype), (plain, lean) in zip([(s, d) for s in (0, 3) for d in ("fp32", "bf16")], results):
        where = f"{kind} stage {stage} {dtype}"
        assert plain["taken"] == 0 and lean["taken"] == (0 if kind == "smoothing" else 4), (where, lean["taken"])
        assert plain["losses"] == lean["losses"], where
        for step, (a, b) in enumerate(zip(plain["grads"], lean["grads"])):
            for i, (ga, gb) in enumerate(zip(a, b)):
                assert torch.equal(ga, gb), f"{where}: step {step} group {i} gradient differs"


def _one_block(kind: str) -> tuple[dict, dict]:
    return _train(kind, 0, "fp32", False), _train(kind, 0, "fp32", True, CPU_BLOCKS)


@pytest.mark.parametrize("kind", ["net", "llama"])
def test_logits_in_one_block_are_left_to_torch(kind):
    """With the CPU's own blocks (2^19 elements) these logits are one block: the mode takes no call, and stands
    aside from the second forward on (idle); the run is torch's."""
    plain, lean = run_distributed(_one_block, 2, kind)[0]
    assert (lean["taken"], lean["idle"]) == (0, [True]), lean
    assert plain["losses"] == lean["losses"]
    assert all(torch.equal(a, b) for x, y in zip(plain["grads"], lean["grads"]) for a, b in zip(x, y))


def test_one_block_would_hold_one_logits_worth_more_in_backward():
    """Why: the blocked loss's backward over a single block holds the logits' gradient beside the block's whole
    log-softmax and its gradient, where torch's holds nll's gradient and log-softmax's (the logits and the kept
    log-softmax are inputs, not counted)."""
    logits = torch.randn(64, 512, requires_grad=True)  # 32768 elements: one CPU block
    targets = torch.randint(0, 512, (64,))
    created = {}
    for name, loss_of in (("torch", F.cross_entropy), ("blocked", cross_entropy_rows)):
        logits.grad = None  # (each backward makes its own gradient, none added into the last one's)
        loss = loss_of(logits, targets)
        with PeakOfNewStorages() as mode:
            loss.backward()
        created[name] = mode.peak
    assert created["blocked"] - created["torch"] == 64 * 512 * 4, created


class _ReturnsLogits(_Net):
    """Returns its logits beside the loss, as a Hugging Face output does."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h).flatten(0, 1)
        return F.cross_entropy(logits, y.flatten()), logits


def _loss_memory(lean: bool) -> dict:
    torch.manual_seed(0)
    cfg = dict(_config(3, "fp32", lean), train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=1)
    engine = zeroplus.initialize(_ReturnsLogits(vocab=4096), cfg)
    x = torch.randint(0, 4096, (8, 128))
    loss, logits = engine(x, x)
    activation = engine.memory_report().categories["activation"]["peak_bytes"]
    del logits
    with PeakOfNewStorages() as created:
        engine.backward(loss)
    engine.step()
    engine.destroy()
    return {"backward": created.peak, "activation": activation}


def test_the_loss_backward_creates_one_logits_worth_less():
    plain, lean = run_distributed(_loss_memory, 1, False)[0], run_distributed(_loss_memory, 1, True)[0]
    logits, block = 8 * 128 * 4096 * 4, block_rows(4096) * 4096 * 4  # 16 MiB; 8 blocks of rows
    # torch: nll's gradient and log-softmax's; lean: the logits' gradient and one block's log-softmax and nll's
    assert plain["backward"] - lean["backward"] == pytest.approx(logits - 2 * block, rel=0.01), (plain, lean)
    # what the first forward left for backward: torch's log-softmax, or the logits the lean loss keeps (the
    # output too: counted as saved, since the loss keeps them whether or not the caller does)
    assert lean["activation"] == pytest.approx(plain["activation"], rel=0.01), (plain, lean)
    assert lean["activation"] > logits
