"""A flat group's gradient (``zero/group_grad.py``): where it is held, read as ``GradState``, and what the ledger
counts in each state; and the states a real engine's groups pass through at 2 ranks with accumulation."""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from zeroplus.ledger import Category, Ledger
from zeroplus.models import GPT, gpt_config
from zeroplus.zero.group_grad import GradState, GroupGrad

pytestmark = pytest.mark.fast  # the fast tier (make test-fast)

SHAPES = [torch.Size([3, 4]), torch.Size([5])]  # 17 elements, padded to 18 for two ranks


def _gradient(keeps: bool, owned: int = 18) -> tuple[GroupGrad, Ledger]:
    ledger = Ledger()
    return GroupGrad("g", SHAPES, [0, 12], 18, owned, torch.float32, torch.device("cpu"), ledger, keeps,
                     partitions=True), ledger


def test_the_flat_buffer_then_the_reduced_gradient_and_what_the_ledger_counts():
    gradient, ledger = _gradient(keeps=False, owned=9)
    assert gradient.state is GradState.EMPTY and ledger.live_bytes(Category.GRAD) == 0
    gradient.accumulate(0, torch.ones(3, 4))
    gradient.accumulate(0, torch.ones(3, 4))
    assert gradient.state is GradState.FLAT and ledger.live_bytes(Category.GRAD) == 18 * 4
    flat = gradient.ensure_flat()
    assert flat[:12].eq(2).all() and flat[12:].eq(0).all()  # a parameter with no gradient reads zeros
    reduced = gradient.new_reduced(torch.float32)
    reduced.copy_(flat[:9])  # (a rank's reduce-scatter, done)
    gradient.drop_flat()
    del flat  # (the ledger counts a buffer until its storage dies)
    assert gradient.state is GradState.REDUCED and ledger.live_bytes(Category.GRAD) == 9 * 4
    with pytest.raises(RuntimeError, match="g: reduced twice in one step"):
        gradient.new_reduced(torch.float32)
    assert gradient.of(0) is None  # this rank owns half the group: no whole parameter to show
    gradient.free()
    assert gradient.state is GradState.EMPTY and gradient.reduced is None


def test_one_rank_keeps_autograds_tensors_until_a_flat_buffer_is_needed():
    gradient, ledger = _gradient(keeps=True)
    first = torch.full((3, 4), 2.0)
    assert gradient.keep(0, first)
    assert gradient.state is GradState.KEPT and gradient.of(0) is first
    assert ledger.live_bytes(Category.GRAD) == 12 * 4  # autograd's tensor counted, nothing copied
    assert gradient.kept_whole() is None  # the second parameter has none
    gradient.settle_kept()  # the step needs the flat form: into the flat buffer, adopted whole as the reduced one
    assert gradient.state is GradState.REDUCED and gradient.reduced is not None
    assert gradient.reduced[:12].eq(2).all() and gradient.reduced[12:].eq(0).all()
    assert ledger.live_bytes(Category.GRAD) == 18 * 4  # the kept tensor let go, the buffer counted
    gradient.free()
    assert gradient.state is GradState.EMPTY and ledger.live_bytes(Category.GRAD) == 0


def _states_through_accumulation(stage: int) -> list[set[str]]:
    """The states of every trained group after each of two accumulated micro-batches and after the step, and those
    seen while a reduction was waited for."""
    torch.manual_seed(0)
    engine = zeroplus.initialize(GPT(gpt_config("tiny", vocab_size=64)), {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage}, "zeroplus": {"log_level": "warning", "memory_estimate": False}})
    waited: set[str] = set()
    wait = GroupGrad.wait

    def wait_and_note(gradient: GroupGrad) -> None:
        if gradient.pending:
            waited.add(gradient.state.value)
        wait(gradient)
    GroupGrad.wait = wait_and_note  # type: ignore[method-assign]
    seen = []
    for seed in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(ids, ids))
        seen.append({g.gradient.state.value for g in engine.partition.groups})
        engine.step()
    seen.append({g.gradient.state.value for g in engine.partition.groups})
    return seen + [waited]


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_move_through_the_states(stage):
    """Stage 1 holds the flat gradient until the boundary and reduces there; stage 2 reduces every micro-batch and
    adds the next one's into the reduced gradient. Every reduction is waited for in ``REDUCING``; after the step
    nothing is held."""
    for first, boundary, after, waited in run_distributed(_states_through_accumulation, 2, stage):
        assert first == ({"flat"} if stage == 1 else {"reduced"}), first
        assert boundary == {"reduced"} and after == {"empty"} and waited == {"reducing"}, (boundary, after, waited)
