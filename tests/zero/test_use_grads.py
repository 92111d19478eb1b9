"""Per-use gradients (``zeroplus/zero/use_grads.py``): a tied parameter's uses and a root embedding's
rows go into the flat gradient buffer as they are computed.

- Memory: during backward the new storages alive at once stay below the flat buffers plus one
  table-sized gradient (tied GPT: the head's use), where autograd's own accumulation holds the
  head's gradient until the embedding's arrives and sums them (two more tables); an untied
  embedding with a small head adds no table-sized gradient at all (its rows go in directly).
  Each bound is checked to fail with the mechanism switched off.
- Values: the gradients equal the plain module's bit for bit at stages 0 and 3 (fp32, repeated
  tokens, a padding index), and the holders get their ``nn.Parameter`` back after every forward,
  also one that raises.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroplus
from tests.graph_nodes import graph_nodes
from tests.models import PlainGPT, SmallHeadNet
from tests.new_storage import NewStorageBytes
from zeroplus.ledger import Category
from zeroplus.models import GPT, gpt_config
from zeroplus.zero import partition as partition_module
from zeroplus.zero.group_grad import GroupGrad

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

VOCAB = 4096


class DirectHeadNet(nn.Module):
    """The head reads the embedding's weight directly (``F.linear``), outside any holder module."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.tanh(block(x))
        logits = nn.functional.linear(x, self.emb.weight)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "warning", "memory_estimate": False}}


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", vocab_size=VOCAB))


def _backward_peak(model: nn.Module, stage: int) -> tuple[int, int]:
    """(peak bytes of new storages during one backward, the ledger's gradient and comm peak in it)."""
    engine = zeroplus.initialize(model, _config(stage))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = engine(ids, ids)
    engine.ledger.reset_peaks()
    with NewStorageBytes() as new:
        engine.backward(loss)
    held = engine.ledger.peak_bytes(Category.GRAD) + engine.ledger.peak_bytes(Category.COMM_BUFFER)
    engine.step()
    return new.peak, held


def _held_when_backward_reaches(module: nn.Module, engine, category: Category) -> list[int]:
    """The ledger's live bytes of ``category`` each time backward reaches ``module``'s output."""
    seen: list[int] = []

    def watch(m: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.append(engine.ledger.live_bytes(category)))
    module.register_forward_hook(watch)
    return seen


@pytest.fixture
def flat_gradients(monkeypatch):
    """Every gradient goes into the flat buffer, as at world size > 1 (one rank keeps autograd's gradients of the
    groups with no per-use parameter instead, ``direct_step.py``): the memory bounds below are those of the flat
    buffer's path, and their counterfactual (routing off) is autograd's accumulation copied into it."""
    monkeypatch.setattr(GroupGrad, "keeps", _NeverKeeps(), raising=False)


class _NeverKeeps:
    """``GroupGrad.keeps`` read as False whatever the group set it to (the flat_gradients fixture)."""

    def __get__(self, group: object, owner: type) -> bool:
        return False

    def __set__(self, group: object, value: bool) -> None:
        pass


@pytest.mark.parametrize("stage", [0, 3])
def test_tied_head_gradient_is_not_held_until_the_embedding(stage, monkeypatch, flat_gradients):
    table = VOCAB * 64 * 4
    peak, held = _backward_peak(_gpt(), stage)
    assert peak <= held + table + table // 4, (peak, held, table)
    monkeypatch.setattr(partition_module, "routed", lambda *args: set())  # autograd's own accumulation
    peak_off, held_off = _backward_peak(_gpt(), stage)
    assert peak_off >= peak + 2 * table - table // 4, (peak_off, peak, table)


def test_embedding_rows_go_into_the_flat_buffer(monkeypatch, flat_gradients):
    table = VOCAB * 64 * 4
    torch.manual_seed(0)
    peak, held = _backward_peak(SmallHeadNet(), 3)
    assert peak <= held + table // 4, (peak, held, table)
    monkeypatch.setattr(partition_module, "routed", lambda *args: set())
    torch.manual_seed(0)
    peak_off, held_off = _backward_peak(SmallHeadNet(), 3)
    assert peak_off >= peak + table - table // 4, (peak_off, peak, table)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_untied_embedding_never_allocates_a_flat_gradient(stage):
    """At stages 2-3 the root's embedding is a group of its own (``-uses``), whose gradient comes only as rows:
    when backward reaches the embedding the gradients held are the head's and the blocks', not a table-sized
    flat buffer (in one group with the head, the table's slice was allocated, and on one rank kept, with the
    head's gradient). Checked to fail with the embedding grouped with the head."""
    table = VOCAB * 64 * 4
    torch.manual_seed(0)
    model = SmallHeadNet()
    engine = zeroplus.initialize(model, _config(stage))
    apart = [g for g in engine.partition.root.groups if g.names == ["emb.weight"]]
    assert len(apart) == 1 and apart[0].name.startswith("<root>#0-uses"), [g.name for g in engine.partition.groups]
    seen = _held_when_backward_reaches(model.emb, engine, Category.GRAD)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16))
        engine.backward(engine(ids, ids))
        assert apart[0].gradient.flat is None
        engine.step()
    assert seen and max(seen) < table // 4, (seen, table)


class PlainLM(PlainGPT):
    """The GPT written with its own module classes (``self.weight[ids]`` embeddings, ``x @ self.weight.t()``
    linears), with its loss: its embeddings are recognised by what they compute, not their class."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB, d=32, layers=2, heads=4, seq=16)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return nn.functional.cross_entropy(super().forward(ids).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("rows", [None, False], ids=["rows", "dense"])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("make", [_gpt, SmallHeadNet, DirectHeadNet, PlainLM],
                         ids=["tied-gpt", "embedding-padding", "use-outside-holder", "own-classes"])
def test_gradients_equal_autograds_bit_for_bit(stage, make, rows, flat_gradients):
    """The engine's gradients (in the flat buffer at stage 0 and the reduced gradient at stage 3, as at world size
    > 1, where an untied embedding sends rows) equal the plain module's ``.grad`` exactly from the same parameters;
    after each step the parameters differ in the last bits (the tied weight's uses are summed in another order
    than autograd's, and this reference is torch's unfused AdamW), so later steps' losses and gradients are
    compared within tolerance. ``zeroplus.embedding_rows`` false: the embeddings' dense gradients go in as any other
    use, the same sums (no rows in the graph)."""
    torch.manual_seed(0)
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    engine = zeroplus.initialize(model, {**_config(stage), "zeroplus": {**_config(stage)["zeroplus"],
                                                                         "embedding_rows": rows}})
    assert any(g.gradient.arrival.per_use for g in engine.partition.groups)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    ref_params = dict(reference.named_parameters())
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        ids = torch.randint(0, 24, (2, 16), generator=g)  # repeated tokens, padding id 0 among them
        loss, ref_loss = engine(ids, ids), reference(ids, ids)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert ("EmbeddingRowsIntoFlatBackward" in graph_nodes(loss)) is (rows is None)
        engine.backward(loss)
        ref_loss.backward()
        for group in engine.partition.groups:
            for index, name in enumerate(group.names):
                mine, theirs = group.gradient.of(index).reshape(-1), ref_params[name].grad.reshape(-1)
                if step == 0:  # same parameters: the same sums
                    assert torch.equal(mine, theirs), name
                else:  # the parameters differ by the steps' last bits
                    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
        engine.step()
        opt.step()
        opt.zero_grad()
    # a use outside the holders keeps the root gathered to the end of backward (its saved tensors read it)
    assert engine.partition.backward.release_root_early is (make is not DirectHeadNet)


def test_stage3_root_is_released_once_its_gradients_are_in():
    """From the second backward on, the root unit (the tied table) is freed when its gradients are in,
    before the embedding's backward; the first backward keeps it (it checks that nothing reads it late).
    In bf16: in fp32 on one rank the parameters stay gathered on the master (``FlatParamGroup.resident``)."""
    model = _gpt()
    engine = zeroplus.initialize(model, {**_config(3), "bf16": {"enabled": True}})
    root_bytes = sum(g.padded_numel * 2 for g in engine.partition.root.groups)
    seen = _held_when_backward_reaches(model.wte, engine, Category.PARAM_GATHERED)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, 16))
        engine.backward(engine(ids, ids))
        engine.step()
    assert seen[0] >= root_bytes and all(b < root_bytes for b in seen[1:]), (seen, root_bytes)


def _after_forward(make, monkeypatch, release: bool, persist: int = 0) -> tuple[list[int], list[float]]:
    """(the gathered bytes when each forward returns, the losses) over 3 bf16 steps at stage 3; units under
    ``persist`` elements stay gathered."""
    if not release:
        monkeypatch.setattr(partition_module.ZeroPartition, "_rows_only", staticmethod(lambda group: False))
    torch.manual_seed(0)
    cfg = {**_config(3), "bf16": {"enabled": True}}
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": persist}
    engine = zeroplus.initialize(make(), cfg)
    gathered, losses = [], []
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 24, (2, 16), generator=g)
        loss = engine(ids, ids)
        gathered.append(engine.ledger.live_bytes(Category.PARAM_GATHERED))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    monkeypatch.undo()
    return gathered, losses


@pytest.mark.parametrize("make", [SmallHeadNet, DirectHeadNet], ids=["embedding", "use-outside-holder"])
def test_stage3_untied_embedding_is_released_when_the_forward_ends(make, monkeypatch):
    """From the second forward on, a root embedding's gathered weight (a group of its own whose gradient comes by
    rows) is freed when the forward returns, not held through backward: its backward runs on the detached
    weight's rows. Not where the first backward saw a use outside the holders (the head reading the weight: its
    saved tensors read it in backward). Training is bit for bit the same as holding it."""
    table = VOCAB * 64 * 2
    held, held_losses = _after_forward(make, monkeypatch, release=False)
    freed, losses = _after_forward(make, monkeypatch, release=True)
    assert losses == held_losses
    assert freed[0] == held[0] and held[1] == held[0], (freed, held)
    if make is SmallHeadNet:
        assert freed[1] == freed[2] == held[1] - table, (freed, held, table)
    else:
        assert freed == held
    # a root under the persistence threshold stays gathered for good (its post-step gather refills the buffer)
    kept, kept_losses = _after_forward(make, monkeypatch, release=True, persist=10**9)
    assert kept_losses == held_losses and kept[1] == kept[2] == kept[0] >= held[0], (kept, held)


def test_holders_get_their_parameters_back_even_when_the_forward_raises():
    model = _gpt()
    engine = zeroplus.initialize(model, _config(3))
    engine.backward(engine(torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)))
    engine.step()
    assert model.lm_head._parameters["weight"] is model.wte._parameters["weight"]
    assert isinstance(model.wte.weight, nn.Parameter)
    with pytest.raises(IndexError):
        engine(torch.full((2, 8), VOCAB + 5), torch.ones(2, 8, dtype=torch.long))
    assert isinstance(model.wte.weight, nn.Parameter) and model.lm_head.weight is model.wte.weight


class LateOutsideNet(nn.Module):
    """A tied head held by its module and, once ``outside`` is set, read directly too (``F.linear``): that use's
    gradient reaches the weight's own hook, after the head's use has let the group be reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.block = nn.Linear(64, 64)
        self.head = nn.Linear(64, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.outside = False

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.block(self.emb(ids)))
        logits = self.head(x)
        if self.outside:
            logits = logits + nn.functional.linear(x, self.emb.weight)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("rows", [None, False], ids=["rows", "dense"])
def test_a_use_outside_the_holders_first_seen_after_the_first_backward_is_refused(rows, flat_gradients):
    """The first backward showed no late use on any rank (``late_uses`` False), so a per-use group reduced early is not
    reduced again at the end of backward (no flag asked each step): a use outside its holders appearing later would be
    lost, and is refused instead, naming the rank, the group and the parameter (see note: early per-use reduction)."""
    torch.manual_seed(0)
    model = LateOutsideNet()
    config = _config(3)
    config["zeroplus"]["embedding_rows"] = rows
    engine = zeroplus.initialize(model, config)
    ids = torch.randint(0, 24, (2, 16), generator=torch.Generator().manual_seed(3))
    engine.backward(engine(ids, ids))
    engine.step()
    assert engine.partition.backward.late_uses is False
    model.outside = True
    late = r"rank 0: a gradient of <root>#0-uses's parameter emb\.weight arrived after the group was reduced"
    with pytest.raises(RuntimeError, match=late):
        engine.backward(engine(ids, ids))
