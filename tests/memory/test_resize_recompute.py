"""Resize-based recompute: bitwise-identical gradients, and the dropped bytes really leave memory.

Gradients: the built-in GPT, a Hugging Face Llama-style model (RMSNorm, SwiGLU with ``nn.SiLU``,
one layer with an HF-style ``GELUActivation`` module) and a model calling the functional forms inline
(``F.layer_norm``, ``F.silu``, ``F.gelu(approximate="tanh")``; one whose forward keeps an output on a module
and reads it in the next block; one whose forward hooks keep outputs and views of them, read after the forward:
those outputs are not dropped), activation functions and norms recomputed,
at stages 0 and 3 in fp32 and bf16 on 2 ranks, with two micro-batches per step: every reduced
gradient (the flat buffer at stage 0, the shard at stage 3) and the loss equal the run without
recompute bit for bit.

Memory: the ledger's ``resize_recompute`` bytes after forward equal the dropped outputs' sizes
computed from the model's shapes, and the process's resident memory after forward (glibc told
to return freed memory) is lower by that amount within 10%.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import LlamaStyleNet, make_batches
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config


class _InlineBlock(nn.Module):
    """A gated MLP written with the functional forms: nothing for a module hook to see."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm_w, self.norm_b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.up, self.gate, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (x.shape[-1],), self.norm_w, self.norm_b)
        return x + self.down(F.silu(self.gate(h)) * F.gelu(self.up(h), approximate="tanh"))


class _InlineNet(nn.Module):
    def __init__(self, vocab: int = 37, d: int = 16, layers: int = 2, block: type = _InlineBlock) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class _StashingBlock(_InlineBlock):
    """Keeps its gate's activation on itself, as a cache a hook fills would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (x.shape[-1],), self.norm_w, self.norm_b)
        self.kept = F.silu(self.gate(h))
        return x + self.down(self.kept * F.gelu(self.up(h), approximate="tanh"))


class _StashingNet(_InlineNet):
    """Each block after the first reads the previous block's kept activation: held on the block when that block
    ends, so not dropped (its read saw a storage of 0 bytes, a segmentation fault, before reads in the forward
    recomputed first; since 2026-11-26/27 such outputs are not dropped at all)."""

    def __init__(self) -> None:
        super().__init__(layers=3, block=_StashingBlock)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, kept = self.emb(x), None
        for block in self.blocks:
            h = block(h) if kept is None else block(h + kept.mean(-1, keepdim=True))
            kept = block.kept
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class _HookedNet(LlamaStyleNet):
    """A user's forward hooks keep the first ``nn.SiLU``'s output and a detached view of the second's (as
    activation statistics do), read after the forward, before backward: those outputs must not be dropped (a
    storage of 0 bytes read there was a segmentation fault). The first is seen by its Python references, the
    second only by its storage's owners."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []
        first, second = [m for m in self.modules() if isinstance(m, nn.SiLU)]
        first.register_forward_hook(lambda _m, _a, out: self.seen.append(out))
        second.register_forward_hook(lambda _m, _a, out: self.seen.append(out.detach()[..., :4]))


class _ScalingBlock(_InlineBlock):
    """Writes its activations in place before the next layer reads them (``h.mul_``, ``g.add_``): the values
    autograd saves are not what a recompute would give, so they must not be dropped (they were, and the
    gradients came out wrong, silently, before the versions were compared)."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, (x.shape[-1],), self.norm_w, self.norm_b)
        a = F.silu(self.gate(h))
        a.mul_(0.5)
        g = self.act(self.up(h))
        g.add_(1.0)
        return x + self.down(a * g)


class _AutocastNet(_InlineNet):
    """Runs its blocks under CPU autocast to bf16; the config also chooses each block's ``up`` Linear by name,
    whose output autocast makes in bf16 from fp32 inputs (a recompute without autocast gave fp32 values). The
    tokens are flattened first: a Linear over 3-d inputs returns a view, whose base counts as one more holder
    (``_held_elsewhere``), and is not dropped."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.emb(x.flatten())
            for block in self.blocks:
                h = block(h)
        return F.cross_entropy(self.head(h.to(self.head.weight.dtype)).float(), y.flatten())


class Standardise(nn.Module):
    """A LayerNorm written out under a name that says nothing of it: chosen by what it computes
    (``module_roles.py``), not by its class name."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale, self.shift = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5) * self.scale + self.shift


class _WrittenBlock(_InlineBlock):
    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.standardise = Standardise(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.standardise(x)
        return x + self.down(F.silu(self.gate(h)) * F.gelu(self.up(h), approximate="tanh"))


def _model(kind: str) -> torch.nn.Module:
    return {"gpt": lambda: GPT(gpt_config("tiny")), "llama": LlamaStyleNet, "inline": _InlineNet,
            "stashing": _StashingNet, "hooked": _HookedNet,
            "scaling": lambda: _InlineNet(block=_ScalingBlock), "autocast": _AutocastNet,
            "written": lambda: _InlineNet(block=_WrittenBlock)}[kind]()


def _config(stage: int, dtype: str, recompute: bool, micro: int = 2, names: tuple[str, ...] = ()) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": dtype == "bf16"}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False,
                         "resize_recompute": {"enabled": recompute, "norms": True,
                                                                     "names": list(names)}}}


def _gradients(kind: str, stage: int, dtype: str, recompute: bool) -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = _model(kind)
    engine = zeroplus.initialize(model, _config(stage, dtype, recompute,
                                                names=("blocks.*.up",) if kind == "autocast" else ()))
    batches = [(x % 37, y % 37) for x, y in make_batches(4 * world, 2, seq=16)]
    out = {"losses": [], "grads": [], "saved": [], "seen": []}
    for step in range(2):
        for micro in range(2):
            x, y = batches[(step * 2 + micro) * world + rank]
            loss = engine(x, y)
            out["saved"].append(engine.ledger.saved_bytes("resize_recompute", Category.ACTIVATION))
            if kind == "hooked":  # read after the forward, before backward
                out["seen"].append([t.sum().item() for t in model.seen])
                model.seen.clear()
            engine.backward(loss)
            out["losses"].append(loss.item())
            if engine.is_gradient_accumulation_boundary():
                out["grads"].append([(g.gradient.flat if stage == 0 else g.gradient.reduced).clone()
                                     for g in engine.partition.groups])
            engine.step()
    assert engine.ledger.saved_bytes("resize_recompute", Category.ACTIVATION) == 0  # all restored in backward
    return out


def _job(kind: str) -> list:
    cases = [(stage, dtype) for stage in (0, 3) for dtype in ("fp32", "bf16")]
    return [(_gradients(kind, s, d, False), _gradients(kind, s, d, True)) for s, d in cases]


@pytest.mark.parametrize("kind", ["gpt", "llama", "inline", "stashing", "hooked", "scaling",
                                  "autocast", "written"])
def test_recompute_gradients_are_bitwise_identical(kind):
    results = run_distributed(_job, 2, kind)[0]
    for (stage, dtype), (plain, recomputed) in zip([(s, d) for s in (0, 3) for d in ("fp32", "bf16")], results):
        where = f"{kind} stage {stage} {dtype}"
        assert all(b > 0 for b in recomputed["saved"]) and not any(plain["saved"]), where
        if kind in ("inline", "written"):  # per block (2) and row (2 x 16), the norm's output (d = 16 wide) and the
            # two activations' (2 d each); the written norm's intermediates too: x - mean and the scaled value (d
            # each) and the reciprocal deviation (1; see note: norms written out)
            expected = 2 * 2 * 16 * (5 * 16 + (2 * 16 + 1 if kind == "written" else 0)) * (4 if dtype == "fp32" else 2)
            assert recomputed["saved"] == [expected] * 4, (where, recomputed["saved"])
        assert plain["losses"] == recomputed["losses"], where
        assert plain["seen"] == recomputed["seen"], where
        for step, (a, b) in enumerate(zip(plain["grads"], recomputed["grads"])):
            for i, (ga, gb) in enumerate(zip(a, b)):
                assert torch.equal(ga, gb), f"{where}: step {step} group {i} gradient differs"


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _forward_memory(recompute: bool) -> dict:
    cfg = gpt_config("small", n_layer=4)
    torch.manual_seed(0)
    engine = zeroplus.initialize(GPT(cfg), dict(_config(0, "fp32", recompute, micro=16), gradient_accumulation_steps=1))
    x = torch.randint(0, cfg.vocab_size, (16, 256))
    for _ in range(2):  # the second forward measures: allocator and lazy state warmed up
        before = _resident_bytes()
        loss = engine(x, x)
        after = _resident_bytes()
        saved = engine.ledger.saved_bytes("resize_recompute", Category.ACTIVATION)
        engine.backward(loss)
        engine.step()
    # GELU outputs (4 * n_embd wide) and the blocks' LayerNorm outputs (ln1, ln2) in fp32; not ln_f's, whose
    # consumer, the head, runs outside the blocks, where the saved-tensor hooks are not (see note: hook scope)
    expected = 16 * 256 * 4 * cfg.n_layer * (4 * cfg.n_embd + 2 * cfg.n_embd)
    return {"held": after - before, "saved": saved, "expected": expected}


def test_recompute_drops_the_outputs_from_memory(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    plain = run_distributed(_forward_memory, 1, False)[0]
    recomputed = run_distributed(_forward_memory, 1, True)[0]
    assert recomputed["saved"] == recomputed["expected"] and plain["saved"] == 0
    dropped = plain["held"] - recomputed["held"]
    assert abs(dropped - recomputed["expected"]) <= 0.1 * recomputed["expected"], (dropped, recomputed)


@pytest.mark.parametrize("where", ["attn.proj", "mlp.proj"])
def test_a_saved_tensor_modified_in_place_after_the_forward_is_an_error(where):
    """With a memory technique on, every tensor saved inside the blocks passes through saved-tensor hooks, where
    autograd does not check in-place modification; the router checks it for the tensors it keeps as they are
    (``attn.proj``'s input), and resize recompute for a chosen output it kept because something else holds it
    (``mlp.proj``'s input, the GELU's output, which the hook keeps). Without either check, backward here would
    silently use the modified values."""
    engine = zeroplus.initialize(GPT(gpt_config("tiny")), {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zeroplus": {"log_level": "warning", "memory_estimate": False, "resize_recompute": {"enabled": True}}})
    x = torch.randint(0, gpt_config("tiny").vocab_size, (2, 16))
    kept: list[torch.Tensor] = []
    handle = engine.module.blocks[0].get_submodule(where).register_forward_pre_hook(
        lambda m, args: kept.append(args[0]))
    loss = engine(x, x)
    handle.remove()
    kept[0].mul_(2)  # the projection's input, which it saved for its weight's gradient
    with pytest.raises(RuntimeError, match=r"saved for backward was modified in place after the forward"):
        engine.backward(loss)


class _Inner(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.act, self.down = nn.GELU(), nn.Linear(d, d)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(u))


class _WritesInputNet(nn.Module):
    """Writes the GELU's input in place after the block holding the GELU has returned (the GELU's output is
    dropped by then)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up, self.inner, self.head = nn.Linear(d, d), _Inner(d), nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.up(x)
        y = self.inner(u)
        u.mul_(2)
        return self.head(y).sum()


def test_an_input_written_in_place_after_the_forward_is_refused_at_recompute():
    """A recompute from inputs written since would give other values than the forward's (silently wrong
    gradients for a module that does not save its input); it raises, naming the module, before the consumer's
    backward reads them (GELU saves its input, so autograd would also refuse, later, at GELU's backward)."""
    torch.manual_seed(0)
    engine = zeroplus.initialize(_WritesInputNet(), {
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zeroplus": {"log_level": "warning", "memory_estimate": False, "resize_recompute": {"enabled": True}}})
    loss = engine(torch.randn(2, 16))
    assert engine.ledger.saved_bytes("resize_recompute", Category.ACTIVATION) == 2 * 16 * 4
    with pytest.raises(RuntimeError, match=r"an input of GELU was modified in place after its forward"):
        engine.backward(loss)


def test_a_written_norm_recomputed_in_backward_leaves_nothing_behind():
    """What a written norm computed is recomputed in backward; the recompute's tensors die with the step (kept as
    themselves by the recompute's hooks, a saved output would hold its own grad_fn: a cycle autograd cannot free,
    32 MiB more each step on the GPT with its own classes). In one process at stage 0: the tensors alive after the
    third step are those after the second."""
    import gc

    torch.manual_seed(0)
    engine = zeroplus.initialize(_InlineNet(block=_WrittenBlock), _config(0, "fp32", True))
    batches = [(x % 37, y % 37) for x, y in make_batches(6, 2, seq=16)]
    alive = []
    for step in range(3):
        for micro in range(2):
            x, y = batches[step * 2 + micro]
            loss = engine(x, y)
            assert engine.ledger.saved_bytes("resize_recompute", Category.ACTIVATION) > 2 * 2 * 16 * 5 * 16 * 4
            engine.backward(loss)
            engine.step()
        gc.collect()
        alive.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    assert alive[2] == alive[1], alive
