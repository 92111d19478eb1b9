"""A budget for every shape of config: a client optimizer (what the Trainer hands over with a
config that has no ``optimizer`` block) is predicted as the config block that builds one like it, with its
hyper-parameters (SGD's momentum decides whether it keeps a state); one the budget cannot size is named in
a warning, and training goes on.

2 gloo ranks, the built-in GPT tiny at ZeRO-3, one step each: the engine's own first-forward budget with
the client optimizer equals, byte for byte, the budget of the same run with the optimizer as a config
block. A failure localises to the optimizer's description (``optim/build.py``: describe_client_optimizer)
or to its hand-over to the estimate (``initialize_engine.py``: _estimate_source).
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from zeroplus.deepspeed_api.ops import DeepSpeedCPUAdam
from zeroplus.models import GPT, gpt_config
from zeroplus.optim.build import describe_client_optimizer


class HomeMadeSGD(torch.optim.SGD):
    """A subclass the budget cannot name: it might keep any state."""


CLIENTS = {
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.9), weight_decay=0.1),
    "SGD": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "SGD-plain": lambda params: torch.optim.SGD(params, lr=1e-3),
    "home-made": lambda params: HomeMadeSGD(params, lr=1e-3),
    # what the Trainer builds for a config with offload_optimizer and no optimizer block (DeepSpeed's name)
    "DeepSpeedCPUAdam": lambda params: DeepSpeedCPUAdam(params, lr=1e-3),
}
BLOCKS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "weight_decay": 0.1}},
    "SGD": {"type": "SGD", "params": {"lr": 1e-3, "momentum": 0.9}},
    "SGD-plain": {"type": "SGD", "params": {"lr": 1e-3}},
    "DeepSpeedCPUAdam": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}},
}


def _run(name: str, as_block: bool) -> dict | None:
    rank, _ = rank_and_world()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "zeroplus": {"log_level": "warning"}}
    if as_block:
        config["optimizer"] = BLOCKS[name]
    optimizer = None if as_block else CLIENTS[name](model.parameters())
    engine = zeroplus.initialize(model, config, optimizer=optimizer)
    x = torch.randint(0, gpt_config("tiny").vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x, x))
    engine.step()
    budget = engine.budget
    if budget is None:
        return None
    # tensors only: the runtime part is this process's first use, measured at each initialize
    tensors = {phase: {c: b for c, b in row.items() if c not in ("runtime", "total")}
               for phase, row in budget.phases.items()}
    return {"states": budget.model_states, "phases": tensors}


@pytest.mark.parametrize("name", ["AdamW", "SGD", "SGD-plain", "DeepSpeedCPUAdam"])
def test_a_client_optimizer_is_predicted_as_its_config_block(name):
    client = run_distributed(_run, 2, name, False)
    block = run_distributed(_run, 2, name, True)
    assert client[0] is not None, "the client optimizer's run has a budget"
    assert client == block
    states = client[0]["states"]["optim_state"]
    master = client[0]["states"]["master"]
    assert states == {"AdamW": 2 * master, "SGD": master, "SGD-plain": 0, "DeepSpeedCPUAdam": 2 * master}[name], \
        client[0]["states"]


def test_an_optimizer_the_budget_cannot_size_is_named_and_training_goes_on():
    assert run_distributed(_run, 2, "home-made", False) == [None, None]  # trained, with no budget
    # what the ranks' warning says (their logs are their own processes')
    with pytest.raises(ValueError, match="HomeMadeSGD is not a torch.optim class.*'optimizer' block"):
        describe_client_optimizer(HomeMadeSGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3))
