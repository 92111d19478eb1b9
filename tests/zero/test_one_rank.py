"""One rank steps autograd's own gradients (``zeroplus/zero/direct_step.py``).

- Values: at world size 1 in fp32 every stage trains ``ParityNet`` (tied weights, a frozen layer, a parameter
  used twice) bit for bit as the plain module with ``torch.optim.AdamW(fused=True)`` or SGD, and an MLP with
  gradient accumulation (a tied weight's uses accumulate in another order across micro-batches,
  ``use_grads.py``); the flat step differs from it at the tensors' last elements (the fused kernels' scalar
  tail), so this fails when groups step flat.
- Memory: a group whose parameters all got a gradient holds autograd's gradients and no flat buffer; the
  ledger counts them (``grad``: 4 bytes per element of every gradient held), and nothing after the step.
- The norm as ``clip_grad_norm_`` forms it wherever every gradient is whole on the rank: one rank, and stage 0 on
  two ranks.
"""
from __future__ import annotations

import copy
import functools
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.graph_nodes import graph_nodes
from tests.models import ParityNet, SmallHeadNet, make_batches
from tests.reference import train_steps
from zeroplus.activations.forward_census import ForwardCensus
from zeroplus.ledger import Category
from zeroplus.zero.group_grad import GradState

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

LR = 1e-2


def _config(stage: int, optimizer: str, gas: int) -> dict:
    params = {"lr": LR, "weight_decay": 0.01} | ({"momentum": 0.9} if optimizer == "SGD" else {})
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "optimizer": {"type": optimizer, "params": params}, "zero_optimization": {"stage": stage},
            "zeroplus": {"log_level": "warning", "memory_estimate": False}}


class Mlp(nn.Module):
    """Widths that leave the fused kernels a scalar tail in every tensor; no embedding, no tied weight."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(a, b) for a, b in ((37, 53), (53, 53), (53, 11)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.mse_loss(x, y)


@pytest.mark.parametrize("model,optimizer,gas", [("parity", "AdamW", 1), ("parity", "SGD", 1), ("parity", "AdamW", 2),
                                                 ("mlp", "AdamW", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_trains_bitwise_as_the_plain_module(stage: int, model: str, optimizer: str, gas: int) -> None:
    torch.manual_seed(0)
    net = ParityNet() if model == "parity" else Mlp()
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(stage, optimizer, gas))
    trained = [p for p in plain.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(trained, lr=LR, weight_decay=0.01, fused=True) if optimizer == "AdamW"
           else torch.optim.SGD(trained, lr=LR, weight_decay=0.01, momentum=0.9, fused=True))
    batches = (make_batches(4 * gas, 2) if model == "parity"
               else [(torch.randn(2, 37), torch.randn(2, 11)) for _ in range(4 * gas)])
    for s in range(4):
        for k in range(gas):
            x, y = batches[s * gas + k]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            (plain(x, y) / gas).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_plain(engine, plain, f"stage {stage}, {model}, {optimizer}, accumulation {gas}")


def _assert_plain(engine: zeroplus.Engine, plain: nn.Module, case: str) -> None:
    """Every trained weight of ``engine`` equals ``plain``'s bit for bit; the engine is destroyed."""
    state = engine.consolidated_fp32_state()
    differ = [n for n, p in plain.named_parameters() if p.requires_grad and not torch.equal(state[n], p.detach())]
    assert not differ, f"{case}: not the plain module's: {differ}"
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_holds_autograds_gradients_and_no_flat_buffer(stage: int) -> None:
    """Every group keeps autograd's gradients, the tied embedding's too (see note: one-rank tied rows): its head's
    gradient reaches ``.grad`` as the head's backward made it (no use routed, no gradient hook) and only the
    embedding's rows are routed, added into it, so no group allocates a flat buffer or a reduced gradient at any
    stage, and the ledger's ``grad`` is the kept bytes."""
    torch.manual_seed(0)
    net = ParityNet()
    engine = zeroplus.initialize(net, _config(stage, "AdamW", 1))
    ledger = engine.ledger
    groups = engine.partition.groups
    assert engine.partition.use_grads.row_receivers == {id(net.embed.weight)}  # (the embedding's rows, only)
    hooked = [n for g in groups for n, p in zip(g.names, g.params) if p._post_accumulate_grad_hooks]
    assert not any(g.gradient.arrival.per_use for g in groups) and not hooked, hooked
    for x, y in make_batches(2, 2):
        engine.backward(engine(x, y))
        assert all(g.gradient.state is GradState.KEPT and g.gradient.kept_whole() is not None for g in groups), \
            [(g.name, g.gradient.state) for g in groups]
        held = sum(t.numel() * 4 for g in groups for t in g.gradient.kept if t is not None)
        assert held == 4 * sum(p.numel() for g in groups for p in g.params) == ledger.live_bytes(Category.GRAD)
        # each kept gradient is its parameter's .grad until the step (see note: one-rank grads in place)
        assert all(p.grad is t for g in groups for p, t in zip(g.params, g.gradient.kept))
        engine.step()
        assert ledger.live_bytes(Category.GRAD) == 0
        assert all(p.grad is None for g in groups for p in g.params)
    engine.destroy()


class CatNet(nn.Module):
    """A weight used through ``torch.cat`` with an activation: autograd's ``.grad`` of it is a view of the cat's
    whole gradient (its rows and the activation's), which holds twice its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.a = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = torch.cat([self.a, self.proj(x[:8])])  # (16, 8)
        return F.mse_loss(x @ w.t(), y)


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_keeps_no_gradient_that_is_a_view_of_more(stage: int) -> None:
    """A ``.grad`` whose storage is larger than it (a view) is not kept: it goes into the flat buffer, so the ledger's
    ``grad`` is every byte the gradients hold (a kept view would hold the rest of its storage uncounted), and the
    engine trains as the plain module (the flat step: within the fused kernels' scalar tail)."""
    torch.manual_seed(0)
    net = CatNet()
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(stage, "AdamW", 1))
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    grads = engine.partition.groups[0].gradient
    for _ in range(3):
        x, y = torch.randn(8, 8), torch.randn(8, 16)
        engine.backward(engine(x, y))
        assert net.a.grad is None or net.a.grad.untyped_storage().nbytes() == net.a.grad.nbytes  # (not the view)
        kept = [t for t in grads.kept if t is not None]
        assert all(t.untyped_storage().nbytes() == t.nbytes for t in kept)
        held = sum(t.nbytes for t in kept) + sum(t.untyped_storage().nbytes() for t in (grads.flat, grads.reduced)
                                                 if t is not None)
        assert grads.flat is not None or grads.reduced is not None
        assert engine.ledger.live_bytes(Category.GRAD) == held
        engine.step()
        plain(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = engine.consolidated_fp32_state()
    for name, value in plain.named_parameters():
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-6, atol=1e-7)
    engine.destroy()


def test_one_rank_resumes_from_a_checkpoint_bitwise_and_lets_the_replaced_states_go(tmp_path) -> None:
    """The per-parameter views are made once and kept (``direct_step._Views``): after ``load_checkpoint`` the step
    count they carry is the loaded one (Adam's bias correction; a stale count changes every weight), and the
    states the load replaced are freed at once, not held by the old views until the next step."""
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(1, "AdamW", 1))
    batches = make_batches(6, 2)
    train = functools.partial(train_steps, engine)
    train(batches[:2])
    engine.save_checkpoint(str(tmp_path), tag="two")
    straight = train(batches[2:6])
    after = {n: t.clone() for n, t in engine.consolidated_fp32_state().items()}
    states = engine.ledger.live_bytes(Category.OPTIM_STATE)
    engine.load_checkpoint(str(tmp_path), tag="two")
    assert engine.ledger.live_bytes(Category.OPTIM_STATE) == states  # (not the old and the loaded ones)
    assert train(batches[2:6]) == straight
    differ = [n for n, t in engine.consolidated_fp32_state().items() if not torch.equal(t, after[n])]
    assert not differ, f"resumed from step 2, not the uninterrupted run: {differ}"
    engine.destroy()


def test_one_rank_step_count_written_in_place_is_the_one_stepped() -> None:
    """A step count the user resets in place (``state["step"].zero_()``, a warm restart of Adam's bias correction)
    is the one the next step uses, as in the plain module: the kept views take the group's count each step."""
    torch.manual_seed(0)
    net = ParityNet()
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(1, "AdamW", 1))
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR, weight_decay=0.01, fused=True)
    for s, (x, y) in enumerate(make_batches(4, 2)):
        if s == 2:
            for states in (engine.optimizer.state.values(), opt.state.values()):
                for state in states:
                    state["step"].zero_()
        engine.backward(engine(x, y))
        engine.step()
        plain(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_plain(engine, plain, "after a step count reset in place")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_takes_gradients_without_hooks_and_keeps_an_untied_embeddings_own(stage: int) -> None:
    """At world size 1 (see note: one-rank hooks) the groups that keep autograd's gradients have no gradient hook
    (their gradients are taken when the backward ends), stage 3 puts no hook on its blocks (every group stays
    gathered; a fault dump finds the unit on the error's stack), and an untied embedding's gradient is autograd's
    dense one, kept: no group allocates a flat buffer, sends rows or routes a use. Trained bit for bit as the plain
    module, with the ledger's ``grad`` the kept gradients' bytes after each backward and nothing after each step."""
    torch.manual_seed(0)
    net = SmallHeadNet(vocab=61)  # an untied embedding: a root parameter that sends rows at world size > 1
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(stage, "AdamW", 1))
    part = engine.partition
    hooked = [n for g in part.groups for n, p in zip(g.names, g.params) if p._post_accumulate_grad_hooks]
    assert not hooked and not any(g.gradient.arrival.per_use for g in part.groups), hooked
    assert part.stage3 is None or not part.stage3.hooked
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids, targets = torch.randint(0, 61, (2, 9), generator=g), torch.randint(0, 8, (2, 9), generator=g)
        engine.backward(engine(ids, targets))
        assert all(g.gradient.flat is None and g.gradient.kept_whole() is not None for g in part.groups)
        kept = sum(t.numel() * 4 for g in part.groups for t in g.gradient.kept if t is not None)
        assert engine.ledger.live_bytes(Category.GRAD) == kept == 4 * sum(p.numel() for p in plain.parameters())
        engine.step()
        assert engine.ledger.live_bytes(Category.GRAD) == 0
        plain(ids, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_plain(engine, plain, f"stage {stage}, an untied embedding")


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("kind", ["loop", "foreach", "fused"])
def test_one_rank_client_optimizer_steps_a_large_parameter_in_pieces(stage: int, kind: str) -> None:
    """A client optimizer that is not fused steps a parameter of more than ``zeroplus.master_step_chunk`` elements as
    pieces of at most that many (rounded down to 1024s), so its temporaries are the pieces' size (torch's for-loop
    AdamW holds two of the largest tensor it steps); bit for bit as the plain module stepping it whole. A fused one
    steps it whole (its kernel treats each tensor's last elements apart)."""
    torch.manual_seed(0)
    net = SmallHeadNet(vocab=4096)  # a 4096 x 64 embedding: 262144 elements
    plain = copy.deepcopy(net)
    options = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    cfg = _config(stage, "AdamW", 1)
    del cfg["optimizer"]
    cfg["zeroplus"]["master_step_chunk"] = 10000  # pieces of 9216
    client = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01, **options)
    stepped: list[int] = []  # the largest tensor each optimizer step was given
    client.register_step_pre_hook(
        lambda opt, args, kwargs: stepped.append(max(p.numel() for pg in opt.param_groups for p in pg["params"])))
    engine = zeroplus.initialize(net, cfg, optimizer=client)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, **options)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        ids, targets = torch.randint(0, 4096, (2, 9), generator=g), torch.randint(0, 8, (2, 9), generator=g)
        engine.backward(engine(ids, targets))
        engine.step()
        plain(ids, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert stepped and max(stepped) == (4096 * 64 if kind == "fused" else 9216), stepped
    _assert_plain(engine, plain, f"stage {stage}, a client AdamW ({kind})")


class RowsFirst(nn.Module):
    """A tied weight whose embedding's backward runs before its dense use's (the embedding is called last), and
    one that is only ever looked up (two embeddings share it, no dense use)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(23, 6)
        self.proj = nn.Linear(6, 23, bias=False)
        self.proj.weight = self.embed.weight
        self.lookup, self.again = nn.Embedding(17, 6), nn.Embedding(17, 6)
        self.again.weight = self.lookup.weight

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)  # (N, 23): the dense use, first in forward, so last in backward
        e = self.embed(ids) + self.lookup(ids % 17) * self.again((ids + 3) % 17)
        return (scores.tanh().sum(-1, keepdim=True) * e).square().mean()


@pytest.mark.parametrize("rows", [None, False], ids=["rows", "dense"])
@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_tied_rows_before_the_dense_use_and_without_one(stage: int, rows: bool | None) -> None:
    """Rows into ``.grad`` (see note: one-rank tied rows) where they come first: ``.grad`` is made of zeros and the
    rows, the dense use's gradient is added in later by autograd; and a weight shared by two embeddings only.
    Bit for bit as the plain module over three steps, with two micro-batches each. ``zeroplus.embedding_rows``
    false: the embeddings run on the weights themselves, autograd's own path (no rows function in the graph)."""
    torch.manual_seed(0)
    net = RowsFirst()
    plain = copy.deepcopy(net)
    cfg = _config(stage, "AdamW", 2)
    cfg["zeroplus"]["embedding_rows"] = rows
    engine = zeroplus.initialize(net, cfg)
    assert engine.partition.use_grads.row_receivers == {id(net.embed.weight), id(net.lookup.weight)}
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for _ in range(2):
            x, ids = torch.randn(2, 4, 6, generator=g), torch.randint(0, 23, (2, 4), generator=g)
            loss = engine(x, ids)
            assert ("EmbeddingRowsIntoFlatBackward" in graph_nodes(loss)) is (rows is None)
            engine.backward(loss)
            engine.step()
            (plain(x, ids) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_plain(engine, plain, f"stage {stage}, rows before the dense use")


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_embeddings_lose_their_hooks_when_rows_stand_down(stage: int) -> None:
    """Where no dense use is routed (one rank in fp32: every tied weight's gradient stays autograd's), an embedding's
    hooks do nothing once rows are off: they go when ``embedding_rows`` stands down (as the budget stands it down under
    ``where_needed``; see note: one-rank hooks), and the model trains on bit for bit as the plain module, the step
    before with rows and the steps after without."""
    torch.manual_seed(0)
    net = RowsFirst()
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(stage, "AdamW", 1))
    embeddings = [net.embed, net.lookup, net.again]
    assert all(m._forward_pre_hooks and m._forward_hooks for m in embeddings)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        if step == 1:
            engine.choices["embedding_rows"].stand_down("off: a test")
            assert not any(m._forward_pre_hooks or m._forward_hooks for m in embeddings)
        x, ids = torch.randn(2, 4, 6, generator=g), torch.randint(0, 23, (2, 4), generator=g)
        loss = engine(x, ids)
        assert ("EmbeddingRowsIntoFlatBackward" in graph_nodes(loss)) is (step == 0)
        engine.backward(loss)
        engine.step()
        plain(x, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _assert_plain(engine, plain, f"stage {stage}, rows stood down")


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_tied_rows_hold_nothing_the_plain_module_does_not(stage: int) -> None:
    """What one forward leaves alive for backward (outside the weights) is what the plain module's leaves: the
    embedding's rows function is made to run by an empty tensor of its own, not by its output made to require
    gradients, which autograd would hold (tokens x hidden) until the backward (see note: one-rank tied rows)."""
    torch.manual_seed(0)
    net = ParityNet()
    plain = copy.deepcopy(net)
    cfg = _config(stage, "AdamW", 1)
    cfg["zeroplus"] |= {"resize_recompute": {"enabled": False}, "lean_cross_entropy": False}  # (as the plain one)
    engine = zeroplus.initialize(net, cfg)
    x, y = make_batches(1, 2, seq=64)[0]
    weights = {p.untyped_storage()._cdata for p in plain.parameters()}
    with ForwardCensus() as census:
        loss = plain(x, y)
    alive_plain = census.alive_bytes(weights)
    del loss
    with ForwardCensus() as census:
        loss = engine(x, y)
    alive = census.alive_bytes(engine.ledger.storage_keys() | {p.untyped_storage()._cdata for p in net.parameters()})
    assert alive == alive_plain, (alive, alive_plain)
    engine.backward(loss)
    engine.destroy()


def test_one_rank_kept_gradients_offloaded_leave_the_ledger_and_come_back_bitwise() -> None:
    """``offload_states(include=["lp_grads"])`` between backward and step moves one rank's kept gradients off and
    back: the ledger's ``grad`` reads 0 while they are off (a group's kept gradients are one entry, counted again at
    the storages' sizes: see note: one-rank tied uses), the kept bytes once they are back, and the values return."""
    torch.manual_seed(0)
    engine = zeroplus.initialize(ParityNet(), _config(1, "AdamW", 1))
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x, y))
    held = engine.ledger.live_bytes(Category.GRAD)
    before = [t.clone() for g in engine.partition.groups for t in g.gradient.kept if t is not None]
    assert held == 4 * sum(t.numel() for t in before) > 0
    engine.offload_states(include=["lp_grads"])
    assert engine.ledger.live_bytes(Category.GRAD) == 0
    assert all(p.grad is None for p in engine.module.parameters())  # (no .grad shows an emptied storage)
    engine.reload_states()
    assert engine.ledger.live_bytes(Category.GRAD) == held
    after = [t for g in engine.partition.groups for t in g.gradient.kept if t is not None]
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    engine.step()
    assert engine.ledger.live_bytes(Category.GRAD) == 0
    engine.destroy()


class _Ops(TorchDispatchMode):
    """The aten operators run under it, by name (``_fused_adamw_`` with whether it was given a ``grad_scale``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.names.append(name + ("(grad_scale)" if kwargs.get("grad_scale") is not None else ""))
        return func(*args, **kwargs)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_binding_clip_is_applied_inside_the_fused_step(stage: int, fused: bool) -> None:
    """A binding clip (see note: clip inside the fused step): with torch's fused AdamW the step divides each gradient
    by ``1 / coef`` in its kernel, with no pass of its own over the gradients (no ``_foreach_mul_``) and no
    ``grad_scale`` left on the optimizer; without the fused kernel the gradients are multiplied first. Either way
    the weights are the plain module's (``clip_grad_norm_`` + AdamW) within the stated tolerance (coefficients that
    differ by an ulp: 1e-5 relative after four steps). The norm itself is ``clip_grad_norm_``'s bit for bit: its
    per-gradient norms stacked in ``model.parameters()``'s order (in another order, 16-lane AVX-512 sums differ by an
    ulp)."""
    torch.manual_seed(0)
    net = ParityNet()
    plain = copy.deepcopy(net)
    config = _config(stage, "AdamW", 1) | {"gradient_clipping": 0.01}
    config["zeroplus"] |= {"fused_optimizer": fused}
    engine = zeroplus.initialize(net, config)
    trained = [p for p in plain.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.01, fused=True)
    for step, (x, y) in enumerate(make_batches(4, 2)):
        engine.backward(engine(x, y))
        with _Ops() as ops:
            engine.step()
        assert engine.get_global_grad_norm() > 0.01  # (the clip binds)
        assert not hasattr(engine.optimizer, "grad_scale")
        if fused:
            assert "_foreach_mul_" not in ops.names and "_fused_adamw_(grad_scale)" in ops.names, ops.names
        else:
            assert "_foreach_mul_" in ops.names and not any(n.startswith("_fused_adamw_") for n in ops.names)
        plain(x, y).backward()
        plain_norm = torch.nn.utils.clip_grad_norm_(trained, 0.01)
        if step == 0:  # the same weights: the norm formed as clip_grad_norm_ forms it
            assert engine.get_global_grad_norm() == plain_norm.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = engine.consolidated_fp32_state()
    for n, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(state[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    engine.destroy()


@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_flat_groups_norm_is_clip_grad_norms(stage: int) -> None:
    """One rank whose groups step flat (LAMB: its trust ratio is a parameter's whole norm, not elementwise) forms the
    norm as ``clip_grad_norm_`` does too, over views of the flat gradient: bit for bit the plain module's norm, with
    no pass of float64 squares (no ``dot``, no copy into a float64 buffer)."""
    torch.manual_seed(0)
    net = ParityNet()
    plain = copy.deepcopy(net)
    config = _config(stage, "Lamb", 1) | {"gradient_clipping": 0.01}
    engine = zeroplus.initialize(net, config)
    assert not engine._step.direct.enabled  # (the flat step, not the direct one)
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x, y))
    with _Ops() as ops:
        engine.step()
    plain(x, y).backward()
    plain_norm = torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.requires_grad], 0.01)
    assert engine.get_global_grad_norm() == plain_norm.item() > 0.01
    assert "dot" not in ops.names, ops.names
    engine.destroy()


def _stage0_norms(_: None) -> dict:
    """One rank of two at stage 0 (an MLP: no tied weight, so each rank's gradient is the plain module's of its
    batch bit for bit), a binding clip: the engine's norm, the norm of the plain module's gradients of both ranks'
    batches accumulated (the ranks' sum), and whether a ``dot`` ran in the step."""
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    net = Mlp()
    plain = copy.deepcopy(net)
    engine = zeroplus.initialize(net, _config(0, "AdamW", 1) | {"gradient_clipping": 0.01})
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 37, generator=gen), torch.randn(2, 11, generator=gen)) for _ in range(2)]
    engine.backward(engine(*batches[rank]))
    with _Ops() as ops:
        engine.step()
    for x, y in batches:
        plain(x, y).backward()
    plain_norm = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.01)
    out = {"norm": engine.get_global_grad_norm(), "plain": plain_norm.item(), "dot": "dot" in ops.names}
    engine.destroy()
    return out


def test_stage_0_on_ranks_forms_the_norm_as_clip_grad_norm() -> None:
    """Stage 0 on two ranks (see note: gradient norm): every rank holds the whole all-reduced sum of the gradients,
    so each forms the norm as ``clip_grad_norm_`` does, with no collective and no float64 pass: on both ranks the
    norm of the ranks' summed gradients over two (their mean's), bit for bit."""
    out = run_distributed(_stage0_norms, 2, None)
    assert out[0]["norm"] == out[1]["norm"] == out[0]["plain"] / 2 > 0.01, out
    assert not any(o["dot"] for o in out), out


def _fp8_run(stage: int, rounding: str, segments: bool) -> tuple[zeroplus.Engine, list[dict], list[int]]:
    """Three steps of two micro-batches with fp8 moments and a binding clip; ``segments`` False: the same engine
    with the direct step off (the flat step, the kept gradients copied into the flat buffer first). Returns the
    engine (``segments``: with its memory estimate), each step's optimizer state of every group, and the ledger's
    ``grad`` bytes before each step."""
    torch.manual_seed(0)
    config = _config(stage, "AdamW", 2) | {"gradient_clipping": 0.01}
    config["zeroplus"] |= {"optimizer_states": {"exp_avg": "fp8", "exp_avg_sq": "fp8", "rounding": rounding},
                           "memory_estimate": segments}
    engine = zeroplus.initialize(ParityNet(), config)
    engine._step.direct.enabled = segments
    states, held = [], []
    batches = make_batches(6, 2)
    for step in range(3):
        for micro, (x, y) in enumerate(batches[2 * step:2 * step + 2]):
            engine.backward(engine(x, y))
            if micro == 1:
                held.append(engine.ledger.live_bytes(Category.GRAD))
            engine.step()
        assert engine.get_global_grad_norm() > 0.01  # (the clip binds: the kernel divides the gradients)
        states.append([{k: v.clone() for k, v in engine.optimizer_state(g).items()} for g in engine.partition.groups])
    return engine, states, held


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_fp8_moments_step_the_kept_gradients_where_they_are(stage: int, rounding: str) -> None:
    """fp8 moments at one rank (their blocks span parameters, so no parameter's view holds whole blocks): each flat
    group steps whole over autograd's kept gradients as segments at the parameters' offsets, which the native loop
    reads where they are, so no flat gradient buffer is made and no gradient copied into one. Weights, moments and
    scales bit for bit the flat step's, which copies them into the flat buffer first (the same engine with the
    direct step off), with a binding clip (each gradient divided in the kernel) over two micro-batches; the ledger's
    ``grad`` holds the kept gradients' bytes and nothing more (the flat step's peak adds the flat buffer), and the
    estimate predicts exactly that."""
    engine, states, held = _fp8_run(stage, rounding, segments=True)
    flat_engine, flat_states, flat_held = _fp8_run(stage, rounding, segments=False)
    assert engine._step.direct.segmented and engine.optimizer.takes_gradient_segments
    groups = engine.partition.groups
    assert all(g.gradient.flat is None for g in groups)
    kept = 4 * sum(p.numel() for g in groups for p in g.params)
    assert held == flat_held == [kept] * 3  # (before the step: kept in both)
    # the estimate steps the same way: its gradient peak is the kept bytes, as measured (the flat step's is more)
    assert engine.budget.category_peaks[Category.GRAD.value] == engine.ledger.peak_bytes(Category.GRAD) == kept
    assert flat_engine.ledger.peak_bytes(Category.GRAD) > kept
    for ours, theirs in zip(states, flat_states):
        for a, b in zip(ours, theirs):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), key
    mine, flat = engine.consolidated_fp32_state(), flat_engine.consolidated_fp32_state()
    assert all(torch.equal(mine[n], flat[n]) for n in flat)
    engine.destroy()
    flat_engine.destroy()


def _fp8_overflow_run(rounding: str, segments: bool) -> list[tuple[list[dict], dict]]:
    """Four fp32 steps with fp8 moments and a binding clip, the third a loss of inf (its gradients not finite);
    each step's optimizer states of every group and fp32 weights."""
    torch.manual_seed(0)
    config = _config(0, "AdamW", 1) | {"gradient_clipping": 0.01}
    config["zeroplus"] |= {"optimizer_states": {"exp_avg": "fp8", "exp_avg_sq": "fp8", "rounding": rounding}}
    engine = zeroplus.initialize(ParityNet(), config)
    engine._step.direct.enabled = segments
    assert engine._step.direct.segmented and all(g.gradient.keeps for g in engine.partition.groups)
    out = []
    for step, (x, y) in enumerate(make_batches(4, 2)):
        loss = engine(x, y)
        engine.backward(loss * float("inf") if step == 2 else loss)
        engine.step()
        out.append(([{k: v.clone() for k, v in engine.optimizer_state(g).items()} for g in engine.partition.groups],
                    engine.consolidated_fp32_state()))
    assert engine.skipped_steps == 1
    engine.destroy()
    return out


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here: the chunked step runs")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_one_rank_fp8_moments_skip_a_step_whose_gradients_are_not_finite(rounding: str) -> None:
    """A step whose gradients are not finite, one rank, fp8 moments stepping the kept gradients as segments with the
    native loop: the stored-states step reads the overflow flag and steps nothing, so weights, moments, scales and
    step counts are left as they were, bit for bit; the steps around it equal the flat step's."""
    ours, flat = _fp8_overflow_run(rounding, True), _fp8_overflow_run(rounding, False)
    for (states, weights), (flat_states, flat_weights) in zip(ours, flat):
        assert all(torch.equal(a[k], b[k]) for a, b in zip(states, flat_states) for k in b)
        assert all(torch.equal(weights[n], flat_weights[n]) for n in flat_weights)
    (before, weights_before), (after, weights_after) = ours[1], ours[2]
    for a, b in zip(before, after):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a
                                                                             if not torch.equal(a[k], b[k])]
    assert all(torch.equal(weights_before[n], weights_after[n]) for n in weights_before)
    assert not all(torch.equal(a[k], b[k]) for a, b in zip(ours[2][0], ours[3][0]) for k in a)  # (the next step steps)


@pytest.mark.parametrize("fused", [True, False])
def test_flat_step_takes_the_clip_inside_the_fused_kernel(fused: bool) -> None:
    """The flat step (bf16 here: one rank's gradients go through the flat buffer) applies a binding clip inside torch's
    fused AdamW too (see note: clip inside the fused step): no ``mul_`` of the fp32 gradient, the scale handed to the
    kernel, nothing left on the optimizer; without the fused kernel the gradient is multiplied first."""
    torch.manual_seed(0)
    config = _config(1, "AdamW", 1) | {"gradient_clipping": 0.01, "bf16": {"enabled": True}}
    config["zeroplus"] |= {"fused_optimizer": fused}
    engine = zeroplus.initialize(ParityNet(), config)
    assert not any(g.gradient.keeps for g in engine.partition.groups)  # (the flat step, not the direct one)
    for x, y in make_batches(2, 2):
        engine.backward(engine(x, y))
        with _Ops() as ops:
            engine.step()
        assert engine.get_global_grad_norm() > 0.01 and not hasattr(engine.optimizer, "grad_scale")
        if fused:
            assert "mul_" not in ops.names and "_fused_adamw_(grad_scale)" in ops.names, ops.names
        else:
            assert "mul_" in ops.names or "_foreach_mul_" in ops.names, ops.names
    engine.destroy()
