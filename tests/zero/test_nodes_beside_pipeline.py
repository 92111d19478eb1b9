"""MiCS beside pipeline parallelism: 8 gloo ranks as pipeline 2 x data 4 (``test_pipeline``'s GPT in 2 stages, 1F1B
over 4 micro-batches, AdamW with binding clipping), ``zeroplus.node_size`` 2. Pipeline stages are the slowest ranks
(stage 0 is ranks 0-3), so a node holds 2 data ranks of one stage, and ``mics_shard_size`` 2 shards each stage's
parameters within a node and replicates them across its nodes (see note: nodes beside tensor).

At ZeRO 1 and 2 (the stages a pipeline runs), MiCS equals flat ZeRO over the stage's 4 data ranks: every batch's loss
and the global gradient norm within 1e-6, every parameter within fp32 tolerance (the gradients are summed in another
order, and Adam turns a gradient that is rounding noise into a step of up to lr), each flat group partitioned over 2
ranks and the replicas' masters bit for bit.
"""
from __future__ import annotations

import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.parallel.test_pipeline import GAS, MICRO, SEQ, STEPS, _config, _gpt
from tests.zero.test_nodes_beside_experts import assert_mics_is_flat
from zeroplus.models.gpt_pipe import gpt_pipeline_layers, gpt_pipeline_loss
from zeroplus.parallel import reset_parallel
from zeroplus.parallel.pipeline import PipelineModule

DATA = 4
CASES = {"flat 1": (1, {}), "mics 1": (1, {"mics_shard_size": 2}), "flat 2": (2, {}),
         "mics 2": (2, {"mics_shard_size": 2})}


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (MICRO, SEQ), generator=g), torch.randint(0, 256, (MICRO, SEQ), generator=g))
            for _ in range(STEPS * GAS * DATA)]


def _job() -> dict[str, dict]:
    out = {}
    for case, (stage, zero) in CASES.items():
        cfg = _config(stage)
        cfg["zero_optimization"] |= zero
        cfg["zeroplus"]["node_size"] = 2
        parallel = zeroplus.init_parallel(cfg)
        model = PipelineModule(gpt_pipeline_layers(_gpt()), gpt_pipeline_loss)
        engine = zeroplus.initialize(model, cfg)
        batches, d = _batches(), parallel.data.rank
        losses, norms = [], []
        for s in range(STEPS):
            losses.append(engine.train_batch(iter([batches[(s * GAS + k) * DATA + d] for k in range(GAS)])).item())
            norms.append(engine.get_global_grad_norm())
        params = {}
        for g in engine.partition.groups:
            full = g.gather_master()
            for name, offset, shape in zip(g.names, g.offsets, g.shapes):
                params[name] = full[offset:offset + shape.numel()].view(shape).clone()
        out[case] = {"losses": losses, "norms": norms, "params": params, "topology": parallel.topology,
                     "shards": {g.dp.size for g in engine.partition.groups},
                     "masters": torch.cat([g.master_param.detach().reshape(-1) for g in engine.partition.groups])}
        engine.destroy()
        reset_parallel()
    return out


def test_mics_beside_pipeline_parallelism_trains_flat_zeros_model():
    ranks = run_distributed(_job, 2 * DATA)
    for rank, runs in enumerate(ranks):
        for stage in (1, 2):
            assert_mics_is_flat(runs[f"mics {stage}"], runs[f"flat {stage}"], f"rank {rank} ZeRO {stage}")
    for stage in (1, 2):  # replicas: data ranks d and d + 2 of one pipeline stage, global r and r + 2
        for a in (0, 1, 4, 5):
            assert torch.equal(ranks[a][f"mics {stage}"]["masters"], ranks[a + 2][f"mics {stage}"]["masters"]), \
                (stage, a)
