"""The collectives a GPU job runs, run with values on gloo (``zeroplus.transport``, ``transports.py``).

``native`` is the transport NCCL and HCCL take: the gradient reducer's reduce-scatter branches and the all-gather
into one tensor, one launch per collective. gloo runs those collectives too, so here they run with values:

- the parity grid of ``test_parity.py`` (stages 0-3, reduce buckets smaller than a weight up to one bucket per
  group, gradient accumulation 2 and binding clipping, AdamW and SGD, ``reduce_scatter`` false, ``overlap_comm``
  false, stage 3 with and without prefetch and persistence) on the native transport at 2 and 4 ranks (at 4 also
  with the optimizer offloaded), against the plain module at the parity tolerance (the pipeline's 1F1B jobs at
  data x pipeline 2 x 2 take it too: ``tests/parallel/test_pipeline.py``);
- every transport against every other at 2 ranks, bitwise (the sum of two numbers does not depend on its order),
  in fp32 and bf16, with the optimizer offloaded: any difference between transports is a failure;
- which collectives ran: a counting wrapper around the transports' tensor collectives and per-rank paths shows the
  native transport launching ``reduce_scatter_tensor``, ``all_gather_into_tensor`` and (a stage-3 unit's groups
  gathered together) the coalesced all-gather, and none of the per-rank
  broadcasts, reduces or row exchanges, and the ``gloo`` transport the reverse (so a native run that fell back
  to the per-rank path fails here, where its values alone would agree);
- tensor, context and expert parallel jobs at 2 ranks take the transport on every group they move bytes over:
  native and gloo give the same bits, and the native run calls none of the per-rank paths;
- what cannot be asked for is refused on every rank, naming the key and the value.
"""
from __future__ import annotations

import collections

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from tests.zero.test_parity import GAS, GRID, MICRO, STEPS, _check_all, _config
from zeroplus import transports
from zeroplus.config import ConfigError
from zeroplus.models import GPT, gpt_config
from zeroplus.models.split import split_gpt
from zeroplus.parallel import parallel_groups, reset_parallel

PER_RANK = ("gather_chunks", "reduce_each", "exchange")  # the gloo and pair transports' paths (transports.py)
NATIVE = ("_reduce_scatter", "_all_gather", "_all_gather_joined")  # the tensor collectives NCCL and HCCL run


def _counting() -> collections.Counter[str]:
    """Count calls of the native collectives and of the per-rank paths in this rank's process."""
    counts: collections.Counter[str] = collections.Counter()
    for name in NATIVE:
        inner = getattr(transports, name)

        def native(*args, _inner=inner, _name=name, **kwargs):
            counts[_name] += 1
            return _inner(*args, **kwargs)
        setattr(transports, name, native)
    for cls in (transports.PerRank, transports.Pair):
        for name in PER_RANK:
            if name not in vars(cls):
                continue
            inner = vars(cls)[name]

            def per_rank(self, *args, _inner=inner, _name=name, **kwargs):
                counts[_name] += 1
                return _inner(self, *args, **kwargs)
            setattr(cls, name, per_rank)
    return counts


def _train(cases: list[dict]) -> list[dict]:
    """Each case trained from the same start; its losses, consolidated fp32 masters, the transport the engine's
    data group took and the collectives it called."""
    rank, world = rank_and_world()
    counts = _counting()
    out = []
    for case in cases:
        cfg = _config(case)
        cfg["zeroplus"]["transport"] = case["transport"]
        if case.get("bf16"):
            cfg["bf16"] = {"enabled": True}
        if case.get("offload"):
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), cfg)
        counts.clear()
        losses = engine_train(engine, make_batches(STEPS * GAS * world, MICRO), STEPS, rank, world, GAS)
        out.append({"losses": losses, "state": engine.consolidated_fp32_state(), "transport": engine.dp.transport,
                    "calls": dict(counts)})
        engine.destroy()
    return out


def _assert_took(case: dict, result: dict) -> None:
    calls = result["calls"]
    native = sum(calls.get(n, 0) for n in NATIVE)
    per_rank = sum(calls.get(n, 0) for n in PER_RANK)
    assert result["transport"] == case["transport"], (case, result["transport"])
    if case["stage"] == 0:
        return  # all-reduces on every transport
    if case["transport"] == "native":
        assert native > 0 and per_rank == 0, (case, calls)
        # the gathers after the step (1-2: every group's as one) or the units' (3: a unit's groups as one; a bucket of
        # 200 splits them), joined (see note: joined gathers)
        assert calls.get("_all_gather_joined", 0) > 0, (case, calls)
        if case["stage"] == 3:
            assert calls.get("_all_gather", 0) > 0, (case, calls)
        if case["stage"] > 0 and case.get("reduce_scatter", True):
            assert calls.get("_reduce_scatter", 0) > 0, (case, calls)
    else:
        assert per_rank > 0 and native == 0, (case, calls)


@pytest.mark.fast
def test_the_parity_grid_on_the_native_transport_at_two_ranks():
    extra = [dict(stage=2, bucket=100, reduce_scatter=False), dict(stage=3, bucket=100, overlap=False),
             dict(stage=3, bucket=100, persist=10**6), dict(stage=3, bucket=100, prefetch=0)]
    cases = [dict(case, transport="native") for case in GRID + extra]
    results = run_distributed(_train, 2, cases)
    _check_all(2, cases, results[0])
    for rank_results in results:
        for case, result in zip(cases, rank_results):
            _assert_took(case, result)


def test_the_native_transport_at_four_ranks():
    cases = [dict(stage=s, bucket=200, transport="native") for s in (1, 2, 3)] \
        + [dict(stage=s, bucket=200, opt="SGD", clip=0.0, transport="native") for s in (0, 3)] \
        + [dict(stage=3, bucket=200, offload=True, transport="native")]  # the optimizer's states on the host
    results = run_distributed(_train, 4, cases)
    _check_all(4, cases, results[0])
    for case, result in zip(cases, results[0]):
        _assert_took(case, result)
    for r in range(1, 4):  # every rank holds the same consolidated master
        for case, a, b in zip(cases, results[0], results[r]):
            for name in a["state"]:
                assert torch.equal(a["state"][name], b["state"][name]), f"{case}: rank {r} {name}"


def test_every_transport_gives_the_same_bits_at_two_ranks():
    setups = [dict(stage=s, bucket=b) for s in (1, 2, 3) for b in (100, 10**8)] \
        + [dict(stage=s, bucket=100, bf16=True) for s in (1, 2, 3)] \
        + [dict(stage=2, bucket=100, offload=True), dict(stage=0, bucket=100)]
    cases = [dict(setup, transport=t) for setup in setups for t in ("native", "gloo", "pair")]
    results = run_distributed(_train, 2, cases)
    for rank_results in results:
        by_setup: dict[int, list[tuple[dict, dict]]] = collections.defaultdict(list)
        for i, (case, result) in enumerate(zip(cases, rank_results)):
            _assert_took(case, result)
            by_setup[i // 3].append((case, result))
        for runs in by_setup.values():
            (first_case, first), *others = runs
            for case, result in others:
                assert result["losses"] == first["losses"], (first_case, case)
                for name, value in first["state"].items():
                    assert torch.equal(result["state"][name], value), f"{first_case} vs {case}: {name}"


SPLITS = {"tensor": {"tensor": 2, "sequence_parallel": True}, "context": {"context": 2},
          "expert": {"expert": 2}}


def _split_job(split: str, transport: str) -> dict:
    """The built-in GPT split over 2 ranks (``SPLITS``), ZeRO-3, 3 steps on the transport; losses, this rank's
    fp32 masters and the collectives called."""
    counts = _counting()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "transport": transport,
                        "parallel": SPLITS[split]}}
    reset_parallel()
    zeroplus.init_parallel(cfg)
    torch.manual_seed(0)
    moe = {"moe_experts": 2, "moe_k": 2} if split == "expert" else {}
    engine = zeroplus.initialize(split_gpt(GPT(gpt_config("tiny", block_size=16, **moe)),
                                           sequence_parallel=split == "tensor"), cfg)
    data = parallel_groups().coordinates.data
    g = torch.Generator().manual_seed(1)
    losses = []
    counts.clear()
    for _ in range(3):
        batch = [torch.randint(0, 256, (2, 16), generator=g) for _ in range(2)]
        x = batch[data]
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = {i: group.gather_master().clone() for i, group in enumerate(engine.partition.groups)}
    out = {"losses": losses, "masters": masters, "calls": dict(counts), "transport": engine.dp.transport}
    engine.destroy()
    reset_parallel()
    return out


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_model_parallel_jobs_take_the_transport_on_every_group(split):
    native = run_distributed(_split_job, 2, split, "native")
    gloo = run_distributed(_split_job, 2, split, "gloo")
    for rank, (a, b) in enumerate(zip(native, gloo)):
        assert (a["transport"], b["transport"]) == ("native", "gloo"), rank
        assert sum(a["calls"].get(n, 0) for n in PER_RANK) == 0, (split, rank, a["calls"])
        assert sum(a["calls"].get(n, 0) for n in NATIVE) > 0, (split, rank, a["calls"])
        assert a["losses"] == b["losses"], (split, rank)
        for key, value in a["masters"].items():
            assert torch.equal(value, b["masters"][key]), f"{split}: rank {rank} group {key}"


def _refused(transport: str, shared: bool) -> str:
    cfg = _config(dict(stage=2, bucket=100))
    cfg["zeroplus"].update(transport=transport, shared_memory_pair=shared)
    try:
        zeroplus.initialize(ParityNet(), cfg)
    except ConfigError as err:
        return str(err)
    return ""


def test_what_cannot_run_is_refused_on_every_rank():
    for said in run_distributed(_refused, 4, "pair", True):  # four ranks share no pair
        assert "'zeroplus.transport' is 'pair'" in said and "4 ranks" in said, said
    for said in run_distributed(_refused, 2, "pair", False):
        assert "'zeroplus.transport' is 'pair'" in said and "shared_memory_pair false" in said, said
    with pytest.raises(ConfigError, match="zeroplus.transport"):
        zeroplus.initialize(ParityNet(), {**_config(dict(stage=1, bucket=100)), "zeroplus": {"transport": "nccl"}})
