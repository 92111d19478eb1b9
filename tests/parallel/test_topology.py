"""The process topology: Megatron's rank order (tensor fastest, then data, then pipeline), expert groups
carved out of the data ranks, every kind of group a partition of the world, and impossible sizes
refused with their numbers (by the pure rank arithmetic, and by ``initialize`` on 2 real ranks)."""
from __future__ import annotations

import pytest

import zeroplus
from tests.dist_helper import run_distributed
from zeroplus.models import GPT, gpt_config
from zeroplus.parallel.topology import KINDS, Topology, check_supported


def test_megatron_rank_order():
    top = Topology(8, tensor=2, pipeline=2)
    assert top.data == 2
    assert top.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert top.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert top.groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert top.groups("model") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    c = top.coordinates(6)
    assert (c.tensor, c.data, c.pipeline) == (0, 1, 1) and top.rank_of(0, 1, 1) == 6


def test_expert_groups_are_carved_out_of_the_data_ranks():
    top = Topology(8, tensor=2, expert=2)
    assert (top.data, top.expert_data) == (4, 2)
    assert top.groups("expert") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert top.groups("expert_data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for rank in range(8):
        c = top.coordinates(rank)
        assert c.data == c.expert + 2 * c.expert_data
        assert set(top.group_of("expert", rank)) | set(top.group_of("expert_data", rank)) <= \
            set(top.group_of("data", rank))


@pytest.mark.parametrize("sizes", [dict(tensor=2, pipeline=2, expert=1), dict(tensor=1, pipeline=1, expert=4),
                                   dict(tensor=2, pipeline=1, expert=2), dict(tensor=4, pipeline=2, expert=1)])
def test_every_kind_partitions_the_world(sizes):
    top = Topology(16, **sizes)
    for kind in KINDS:
        members = sorted(r for group in top.groups(kind) for r in group)
        assert members == list(range(16)), kind


def test_impossible_sizes_name_their_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor x pipeline = 4 x 1"):
        Topology(6, tensor=4)
    with pytest.raises(ValueError, match=r"expert-parallel size 3 does not divide the data-parallel size 4"):
        Topology(8, tensor=2, expert=3)
    with pytest.raises(ValueError, match=r"tensor must be a positive integer, got 0"):
        Topology(4, tensor=0)
    with pytest.raises(ValueError, match=r"ZeRO stage 3 with pipeline parallelism \(pipeline size 2\)"):
        check_supported(Topology(4, pipeline=2), 3)
    check_supported(Topology(4, pipeline=2), 2)


def _refused(parallel: dict, stage: int) -> str:
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}},
           "zero_optimization": {"stage": stage}, "zeroplus": {"parallel": parallel, "memory_estimate": False}}
    try:
        zeroplus.initialize(GPT(gpt_config("tiny")), cfg)
    except zeroplus.ConfigError as err:
        return str(err)
    return "accepted"


def test_initialize_refuses_what_the_world_cannot_hold():
    messages = run_distributed(_refused, 2, {"tensor": 3}, 1)
    assert all("world size 2 is not divisible by tensor x pipeline = 3 x 1" in m for m in messages), messages
    messages = run_distributed(_refused, 2, {"pipeline": 2}, 3)
    assert all("ZeRO stage 3 with pipeline parallelism (pipeline size 2)" in m and "rank" in m for m in messages)


def _refused_model(family: str | None, config: dict) -> str:
    from tests.hf_models import build
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {}},
           "zero_optimization": {"stage": 1}, "zeroplus": {"memory_estimate": False}, **config}
    try:
        zeroplus.initialize(build(family) if family else GPT(gpt_config("tiny")), cfg)
    except zeroplus.ConfigError as err:
        return str(err)
    return "accepted"


def test_a_tensor_or_expert_size_the_model_cannot_take_is_refused_on_every_rank():
    """DeepSpeed's AutoTP key on a Hugging Face GPT-2 (no tensor-parallel plan in its config: Llama-family models are
    split by theirs, tests/parallel/test_autotp.py), and expert parallelism on a model without experts: every rank
    refuses at initialize, naming the key, its size, the model class and what would work (rather than training the
    whole model on every rank of a tensor group, with a data-parallel size of 1)."""
    messages = run_distributed(_refused_model, 2, "gpt2", {"tensor_parallel": {"autotp_size": 2}})
    for rank, m in enumerate(messages):
        assert "'tensor_parallel.autotp_size'" in m and "is 2 (rank" in m and "GPT2LMHeadModel" in m \
            and "no base_model_tp_plan" in m and "Use tensor size 1" in m, f"rank {rank}: {m}"
    messages = run_distributed(_refused_model, 2, None, {"zeroplus": {"parallel": {"expert": 2},
                                                                      "memory_estimate": False}})
    for rank, m in enumerate(messages):
        assert "'zeroplus.parallel.expert' is 2" in m and "a GPT" in m and "Use expert size 1" in m, f"rank {rank}: {m}"
