"""Virtual host memory for optimizer states (``zeroplus.virtual_optimizer_states``, Ascend NPUs).

The NPU's swapped-memory allocator and ``npu_apply_adam_w`` kernel do not exist here. What runs
here: the engine refuses the option on this machine naming the key; and, with a CPU twin of the
kernel written from its documented formula (``zeroplus/kernels/npu_adam_w.py``), the engine's use of it (beta
powers, step count, options per param group, gradient scaling and clipping) trains like torch's
AdamW at stages 1 and 3 on 2 ranks (within 1e-5: the kernel folds the bias corrections in another
order), keeps no optimizer-state bytes in device memory per the ledger, and a checkpoint of the
states reads and writes them through ``fill_(1).mul_``, exactly.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.models import ParityNet, make_batches
from tests.reference import engine_train
from zeroplus.kernels import npu_adam_w
from zeroplus.ledger import Category, Ledger
from zeroplus.offload import virtual_host

TWIN = (npu_adam_w.allocate, npu_adam_w.apply_adam_w)  # the NPU kernels' CPU twins


def _config(stage: int, virtual: bool, optimizer: str = "AdamW") -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": optimizer, "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "virtual_optimizer_states": virtual}}


def _job(stage: int) -> dict:
    rank, world = rank_and_world()
    out = {}
    for virtual in (False, True):
        virtual_host.CPU_TWIN = TWIN if virtual else None
        torch.manual_seed(0)
        engine = zeroplus.initialize(ParityNet(), _config(stage, virtual))
        losses = engine_train(engine, make_batches(5 * world, 2), 5, rank, world, 1)
        out[virtual] = {"losses": losses, "masters": engine.consolidated_fp32_state(),
                        "resident": engine.ledger.live_bytes(Category.OPTIM_STATE),
                        "kept_off": engine.ledger.saved_bytes(virtual_host.TECHNIQUE, Category.OPTIM_STATE),
                        "owned": sum(g.owned_numel for g in engine.partition.groups)}
    virtual_host.CPU_TWIN = None
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_steps_through_the_kernel_like_adamw(stage):
    result = run_distributed(_job, 2, stage)[0]
    plain, virtual = result[False], result[True]
    for a, b in zip(plain["losses"], virtual["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (plain["losses"], virtual["losses"])
    for name, value in plain["masters"].items():
        torch.testing.assert_close(virtual["masters"][name], value, rtol=1e-5, atol=1e-6)
    assert plain["resident"] == 8 * plain["owned"]
    assert virtual["resident"] == 0 and virtual["kept_off"] == 8 * virtual["owned"]


def test_states_round_trip_exactly_through_a_checkpoint():
    states = virtual_host.VirtualStates(1000, torch.device("cpu"), Ledger(), TWIN)
    master = torch.randn(1000)
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    for _ in range(3):
        states.step(master, torch.randn(1000), group)
    saved = states.state()
    other = virtual_host.VirtualStates(1000, torch.device("cpu"), Ledger(), TWIN)
    other.load(saved)
    assert other.steps == 3 and float(saved["step"]) == 3.0
    assert torch.equal(other.exp_avg, states.exp_avg) and torch.equal(other.exp_avg_sq, states.exp_avg_sq)


def test_refused_where_it_cannot_run():
    virtual_host.CPU_TWIN = None
    with pytest.raises(zeroplus.ConfigError, match=r"zeroplus.virtual_optimizer_states' needs an Ascend NPU.*cpu"):
        zeroplus.initialize(ParityNet(), _config(1, True))
    virtual_host.CPU_TWIN = TWIN
    try:
        with pytest.raises(zeroplus.ConfigError, match="needs AdamW.*not SGD"):
            zeroplus.initialize(ParityNet(), dict(_config(1, True, "SGD"),
                                                  optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    finally:
        virtual_host.CPU_TWIN = None
