"""fp32 parity of ZeRO stages 0-3 with the single-process reference (``tests/reference.py``).

Grid: stage x reduce bucket size (11 elements, smaller than any parameter (13 the smallest); 100; one bucket per group)
x world size (1, 2, 4), with gradient accumulation (2) and binding global-norm clipping, on ``ParityNet`` (sizes not
divisible by the world size, tied weights, a frozen layer, a parameter used twice, parameters outside the repeated
blocks); at 2 and 4 ranks also with the embeddings' rows off (``zeroplus.embedding_rows`` false, as an accelerator's
defaults run where the memory is not needed). Losses of rank 0 and the final fp32 parameters must agree within 1e-6
relative (``assert_close`` with rtol=1e-6 and an absolute floor of 3e-6 times the tensor's largest value: at world 4 the
order in which a gradient's four parts are summed follows which rank owns it, and after 5 AdamW steps ``out_bias`` sits
1.2-1.6e-6 of its largest value from the reference at every bucket size, measured). A failure names the case: which
stage, bucket size and world size, and which parameter, localises the fault to the reduction (bucket), the gather (stage
3) or the shard bookkeeping (world size).
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train, reference_train

STEPS, GAS, MICRO, LR, CLIP = 5, 2, 2, 1e-2, 0.5


def _config(case: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "gradient_clipping": case.get("clip", CLIP),
        "optimizer": {"type": case.get("opt", "AdamW"), "params": _opt_params(case.get("opt", "AdamW"))},
        "zero_optimization": {"stage": case["stage"], "reduce_bucket_size": case["bucket"],
                              "reduce_scatter": case.get("reduce_scatter", True),
                              "overlap_comm": case.get("overlap", True),
                              "stage3_param_persistence_threshold": case.get("persist", 0),
                              "stage3_prefetch_bucket_size": case.get("prefetch", 200)},
        "zeroplus": {"log_level": "warning", "memory_estimate": False, "embedding_rows": case.get("rows")},
    }


def _opt_params(name: str) -> dict:
    if name == "SGD":
        return {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}
    return {"lr": LR, "weight_decay": 0.01}


def run_cases(cases: list[dict]) -> list[dict]:
    rank, world = rank_and_world()
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = ParityNet()
        engine = zeroplus.initialize(model, _config(case))
        batches = make_batches(STEPS * GAS * world, MICRO)
        losses = engine_train(engine, batches, STEPS, rank, world, GAS)
        state = engine.consolidated_fp32_state()
        out.append({"losses": losses, "state": state, "norm": engine.get_global_grad_norm()})
    return out


def _reference(world: int, case: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = ParityNet()
    batches = make_batches(STEPS * GAS * world, MICRO)
    return reference_train(model, batches, STEPS, world, GAS, LR, case.get("clip", CLIP),
                           optimizer=case.get("opt", "AdamW"))


def _check_all(world: int, cases: list[dict], results: list[dict]) -> None:
    refs: dict[tuple, tuple] = {}
    for case, result in zip(cases, results):
        key = (case.get("clip", CLIP), case.get("opt", "AdamW"))
        if key not in refs:
            refs[key] = _reference(world, case)
        _assert_parity(result, *refs[key], f"world {world} {case}")


def _assert_parity(result: dict, ref_losses: list[float], ref_state: dict, label: str) -> None:
    ref_rank0 = ref_losses  # reference_train reports rank 0's micro-batches
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_rank0), rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{label}: losses differ\n{m}")
    for name, value in result["state"].items():
        ref = ref_state[name]
        floor = 3e-6 * ref.abs().max().item()
        torch.testing.assert_close(value, ref, rtol=1e-6, atol=floor,
                                   msg=lambda m, n=name: f"{label}: parameter {n} differs\n{m}")
    trainable = {n for n, p in ParityNet().named_parameters() if p.requires_grad}
    assert set(result["state"]) == trainable, f"{label}: masters cover {sorted(result['state'])}"


# SGD without binding clipping catches gradient-scale errors that Adam and clipping would hide.
GRID = [dict(stage=s, bucket=b) for s in (0, 1, 2, 3) for b in (11, 100, 10**8)] + \
    [dict(stage=s, bucket=b, opt="SGD", clip=0.0) for s in (0, 1, 2, 3) for b in (100, 10**8)]


@pytest.mark.fast
def test_parity_world_1():
    _check_all(1, GRID, run_cases(GRID))


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.fast), 4])
def test_parity_distributed(world):
    extra = [dict(stage=2, bucket=100, reduce_scatter=False), dict(stage=3, bucket=100, overlap=False),
             dict(stage=3, bucket=100, persist=10**6), dict(stage=3, bucket=100, prefetch=0),
             dict(stage=1, bucket=7, reduce_scatter=False)] + [dict(stage=s, bucket=100, rows=False) for s in (2, 3)]
    # Four ranks share two cores: keep the per-collective count down there (buckets of 200 elements
    # still cut every weight matrix (481 elements) in pieces; 11-element buckets run at two ranks). Data groups
    # of 4 at every stage, with AdamW and clipping, are also in tests/parallel/test_expert_parallel.py.
    cases = GRID + extra if world == 2 else [dict(stage=s, bucket=200) for s in (1, 2)] \
        + [dict(stage=s, bucket=200, opt="SGD", clip=0.0) for s in (0, 3)] + [dict(stage=3, bucket=200, rows=False)]
    results = run_distributed(run_cases, world, cases)
    _check_all(world, cases, results[0])
    for r in range(1, world):  # every rank holds the same consolidated master
        for case, a, b in zip(cases, results[0], results[r]):
            for name in a["state"]:
                assert torch.equal(a["state"][name], b["state"][name]), f"world {world} {case}: rank {r} {name}"
