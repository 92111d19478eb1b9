"""What a process pays once, the first time it trains anything: measured in the process itself.

On CPU most of a training process's non-tensor memory is paid by the first forward, backward and
optimizer step it ever runs, whatever the model: kernel code paged in from torch's libraries,
oneDNN's generated kernels, autograd's worker thread, the meta-device kernels the estimate runs.
A process that has trained something already (a test session, a script that evaluated its model
first, the Trainer after an evaluation) has it in its baseline; a fresh one pays it inside the
engine. Measured here (a one-block GPT in the run's compute dtype): a script that had trained a small
model before ``initialize`` measured 13 MiB of engine peak where a fresh one measured 26, both
predicted 26 from the probe's constant.

``pay(dtype)`` runs ``first_use_work`` in this process and returns how much resident memory it
added: the whole first-use cost in a fresh process, about nothing in one that has paid it. The
runtime probe (``runtime_probe.py``) runs it before its own engine, so the overhead it keeps is
what remains beyond first use; ``initialize`` runs it before building the engine, and the
engine's prediction adds what it measured (``runtime_overhead.runtime_bytes``). On an
accelerator the budget predicts the caching allocator, which holds tensors only: nothing to pay.

Memory: a one-block GPT's own (0.1 MiB of parameters, its Adam states and a 2 x 24 token batch),
freed on return; what stays is the first-use cost itself. Time: about a second in a fresh process (the
same libraries the first real step would load), milliseconds after that. The global random state
is left as it was (the work draws from its own generator), so seeded runs do not change.
"""
from __future__ import annotations

import torch

from ..accelerator import Accelerator
from ..models import GPT, gpt_config
from ..parallel.groups import one_rank, using

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SEQ = 24
# shapes no model shares by chance (the probe's GPT-tiny included): oneDNN generates a kernel per
# matrix shape, and those of the model trained are the engine's to pay, in the probe as in a real run
_SHAPES = {"n_layer": 1, "n_head": 3, "n_embd": 48}


def first_use_work(dtype: str) -> None:
    """GPT-tiny trained one step as the engine trains: forward and backward in ``dtype``, the gradients
    into fp32 weights stepped by ``torch.optim.AdamW`` (a 16-bit optimizer step would load kernels the
    engine never runs: 9 MiB of them in bf16 here); then its copy on the meta device run forward and
    backward: the kernels any training step and any estimate load."""
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), using(one_rank()):  # not the job's groups
        torch.manual_seed(0)
        config = gpt_config("tiny", **_SHAPES)
        master = GPT(config)
        compute = GPT(config).to(DTYPES[dtype])
        compute.load_state_dict(master.state_dict())
        tokens = torch.randint(0, config.vocab_size, (2, _SEQ))
        compute(tokens, tokens).backward()
        for m, c in zip(master.parameters(), compute.parameters()):
            m.grad = c.grad.float() if c.grad is not None else None
        torch.optim.AdamW(master.parameters(), lr=1e-4).step()
        with torch.device("meta"):
            shadow = GPT(config).to(DTYPES[dtype])
        meta_tokens = tokens.to("meta")
        shadow(meta_tokens, meta_tokens).backward()


def pay(dtype: str) -> int:
    """Run ``first_use_work(dtype)`` and return the resident bytes it left (0 if it left none)."""
    host = Accelerator()
    before = host.memory_allocated()
    first_use_work(dtype)
    return max(0, host.memory_allocated() - before)


__all__ = ["DTYPES", "first_use_work", "pay"]
