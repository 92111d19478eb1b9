"""Pipeline parallelism with ZeRO on 4 CPU ranks, data x pipeline = 2 x 2, against the single-process
GPT.

The built-in GPT (4 blocks, so 6 pipeline layers: embeddings, blocks, norm and head; the head untied
from the token table, in the reference too) is cut into 2 stages; each data replica runs 1F1B over 4
micro-batches per batch with ZeRO-1 or ZeRO-2 inside each stage's data group, and the interleaved
schedule (2 virtual stages per rank: 4 chunks of the 6 layers) with ZeRO-1 and ZeRO-2, and with one extra
warm-up forward per stage (ZeRO-2), which must give the interleaved run's losses, norms and parameters bit for
bit. The 1F1B runs take the native transport (``zeroplus.transport``: the reduce-scatters and all-gathers NCCL runs),
the interleaved ones gloo's per-rank paths; the losses agree bit for bit across them. The reference
is the plain model with ``torch.optim.AdamW`` accumulating the same 8 micro-batches per step,
clipped by the global norm. Checked: each batch's mean loss on every stage, the global gradient norm
(summed over the stages), every parameter after 3 steps and the trained model's ``eval_batch`` loss,
within fp32 tolerance; a failure names the stage, the ZeRO stage and the layer. Tensor x pipeline =
2 x 2: the tensor-parallel GPT (sequence parallel, 2 overlap chunks) in 2 stages gives the single-
process model's losses and gradient norms (the same 4-rank run). ``zeroplus.estimate`` for each
stage predicts the model-state peaks the ledger measured.
"""
from __future__ import annotations

import pytest
import torch

import zeroplus
from tests.dist_helper import run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks
from tests.reference import clip_global_norm
from zeroplus.models import GPT, gpt_config
from zeroplus.models.gpt_pipe import gpt_pipeline_layers, gpt_pipeline_loss, untie_head
from zeroplus.models.gpt_tp import TensorParallelGPT, tensor_parallel_pipeline_layers
from zeroplus.parallel.pipeline import PipelineModule
from zeroplus.parallel.pipeline_schedule import schedule

STEPS, MICRO, SEQ, GAS, CLIP, LR = 3, 2, 16, 4, 0.5, 1e-2


def _gpt() -> GPT:
    torch.manual_seed(0)
    return untie_head(GPT(gpt_config("tiny", n_layer=4, block_size=SEQ)))


def _batches() -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 256, (MICRO, SEQ), generator=g), torch.randint(0, 256, (MICRO, SEQ), generator=g))
            for _ in range(STEPS * GAS * 2)]


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
            "zeroplus": {"log_level": "warning", "memory_estimate": False, "parallel": {"pipeline": 2}}}


# (ZeRO stage, virtual stages per rank, one extra warm-up forward): 1F1B, interleaved, interleaved + 1 warm-up
CASES = [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 2, True)]


def _pipeline_job() -> list:
    out = []
    for stage, virtual, extra in CASES:
        cfg = _config(stage)
        cfg["zeroplus"]["transport"] = "native" if virtual == 1 else "auto"  # 1F1B on the collectives a GPU runs
        parallel = zeroplus.init_parallel(cfg)
        model = PipelineModule(gpt_pipeline_layers(_gpt()), gpt_pipeline_loss, virtual_stages=virtual,
                               extra_warmup=extra)
        engine = zeroplus.initialize(model, cfg)
        batches, d = _batches(), parallel.data.rank
        losses, norms = [], []
        for s in range(STEPS):
            mine = iter([batches[(s * GAS + k) * 2 + d] for k in range(GAS)])
            losses.append(engine.train_batch(mine).item())
            norms.append(engine.get_global_grad_norm())
        params = {}
        for g in engine.partition.groups:
            full = g.gather_master()
            for name, offset, shape in zip(g.names, g.offsets, g.shapes):
                params[model.global_layer(name)] = full[offset:offset + shape.numel()].view(shape).clone()
        held_out = engine.eval_batch(iter([batches[0]] * GAS)).item()  # forward only, after training
        out.append({"losses": losses, "norms": norms, "params": params, "data_rank": d, "held_out": held_out,
                    "pipeline_stage": model.stage, "transport": engine.dp.transport,
                    "ledger": ledger_peaks(engine)})
        engine.destroy()
    zeroplus.parallel.reset_parallel()
    return {"cases": out, "tensor_x_pipeline": _tp_pipeline_job()}


def _reference() -> tuple[list[list[float]], list[float], dict[str, torch.Tensor], float]:
    model, batches = _gpt(), _batches()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses: list[list[float]] = [[], []]
    norms = []
    for s in range(STEPS):
        per_rank = [0.0, 0.0]
        for k in range(GAS):
            for r in range(2):
                x, y = batches[(s * GAS + k) * 2 + r]
                loss = model(x, y)
                (loss / (2 * GAS)).backward()
                per_rank[r] += loss.item() / GAS
        for r in range(2):
            losses[r].append(per_rank[r])
        norms.append(clip_global_norm(list(model.parameters()), CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        held_out = model(*batches[0]).item()
    layers = torch.nn.ModuleList(gpt_pipeline_layers(model))
    return losses, norms, {n: p.detach() for n, p in layers.named_parameters()}, held_out


@pytest.fixture(scope="module")
def pipeline_ranks() -> list:
    """One 4-rank run: the data x pipeline cases, then tensor x pipeline."""
    return run_distributed(_pipeline_job, 4)


def test_data_x_pipeline_1f1b_and_interleaved_match_the_single_process_model(pipeline_ranks):
    ranks = [r["cases"] for r in pipeline_ranks]
    ref_losses, ref_norms, ref_params, ref_held_out = _reference()
    assert ref_norms[0] > CLIP
    for rank, results in enumerate(ranks):
        by_case = dict(zip(CASES, results))
        for (zero_stage, virtual, extra), got in by_case.items():
            where = (f"rank {rank} (pipeline stage {got['pipeline_stage']}, data {got['data_rank']}), "
                     f"ZeRO {zero_stage}, {virtual} virtual stages" + (", one extra warm-up" if extra else ""))
            if extra:  # the same backward order as the interleaved schedule: the same run bit for bit
                twin = by_case[(zero_stage, virtual, False)]
                assert got["losses"] == twin["losses"] and got["norms"] == twin["norms"], where
                assert all(torch.equal(v, twin["params"][n]) for n, v in got["params"].items()), where
                # and the losses of 1F1B bit for bit (the bar); the norm sums the same squares over other
                # flat groups (the chunks split the stage), in float64: equal to its last bits
                one_f_one_b = by_case[(zero_stage, 1, False)]
                assert got["losses"] == one_f_one_b["losses"], f"{where}: losses against 1F1B"
                assert got["norms"] == pytest.approx(one_f_one_b["norms"], rel=1e-12), f"{where}: norms against 1F1B"
            assert got["losses"] == pytest.approx(ref_losses[got["data_rank"]], rel=2e-5), f"{where}: losses"
            assert got["norms"] == pytest.approx(ref_norms, rel=2e-5), f"{where}: grad norms"
            assert got["held_out"] == pytest.approx(ref_held_out, rel=2e-5), f"{where}: eval_batch loss"
            assert got["params"], f"{where}: holds no parameters"
            assert (got["transport"] == "native") == (virtual == 1), f"{where}: {got['transport']}"
            for name, value in got["params"].items():  # Adam: rounding noise decides near-zero gradients' updates
                torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=LR / 10,
                                           msg=lambda m, n=name: f"{where}, {n}: {m}")
            if got["data_rank"] == 0 and not extra:  # data rank 1 holds the same shapes
                _check_estimate(got["ledger"], zero_stage, virtual, rank, where)
    held = set().union(*(set(r[0]["params"]) for r in ranks))
    assert held == set(ref_params), "the stages together hold every layer"


def _check_estimate(measured: dict[str, int], stage: int, virtual: int, rank: int, where: str) -> None:
    """``zeroplus.estimate`` of this rank (its stage's layers over its data group of 2, the real 1F1B or
    interleaved schedule with simulated sends) predicts the model-state peaks the ledger measured."""
    budget = zeroplus.estimate(lambda: PipelineModule(gpt_pipeline_layers(_gpt()), gpt_pipeline_loss,
                                                      virtual_stages=virtual),
                               _config(stage), world_size=4, rank=rank, seq_len=SEQ)
    assert_model_states_predicted(measured, where, estimate=budget.category_peaks)


def _tp_pipeline_job() -> dict:
    """Tensor 2 x pipeline 2 (data 1): the tensor-parallel GPT, sequence parallel in 2 chunks, in 2 stages."""
    cfg = _config(1)
    cfg["zeroplus"]["parallel"] = {"tensor": 2, "pipeline": 2, "sequence_parallel": True, "overlap_chunks": 2}
    parallel = zeroplus.init_parallel(cfg)
    layers, loss_fn = tensor_parallel_pipeline_layers(TensorParallelGPT.from_dense(_gpt(), sequence_parallel=True,
                                                                                   overlap_chunks=2))
    model = PipelineModule(layers, loss_fn)
    engine = zeroplus.initialize(model, cfg)
    batches, losses, norms = _batches(), [], []
    for s in range(STEPS):
        losses.append(engine.train_batch(iter([batches[(s * GAS + k) * 2] for k in range(GAS)])).item())
        norms.append(engine.get_global_grad_norm())
    return {"losses": losses, "norms": norms, "tensor_rank": parallel.tensor.rank}


def test_tensor_x_pipeline_matches_the_single_process_model(pipeline_ranks):
    ranks = [r["tensor_x_pipeline"] for r in pipeline_ranks]
    model, batches = _gpt(), _batches()  # the reference: data rank 0's micro-batches only (data size 1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for s in range(STEPS):
        total = 0.0
        for k in range(GAS):
            x, y = batches[(s * GAS + k) * 2]
            loss = model(x, y)
            (loss / GAS).backward()
            total += loss.item() / GAS
        losses.append(total)
        norms.append(clip_global_norm(list(model.parameters()), CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for rank, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(losses, rel=2e-5), f"rank {rank}: losses"
        assert got["norms"] == pytest.approx(norms, rel=2e-5), f"rank {rank}: grad norms"


def _runs_to_the_end(P: int, m: int, v: int, extra: bool) -> bool:
    """Every stage's ops run with blocking receives and sends that never block (isend): a forward of global
    chunk g waits for g - 1's forward of the micro-batch, a backward for g + 1's backward; True if every stage
    finishes (no deadlock)."""
    ops = [schedule(P, r, m, v, extra) for r in range(P)]
    done: set[tuple[str, int, int]] = set()  # (kind, micro-batch, global chunk)
    at = [0] * P
    progress = True
    while progress:
        progress = False
        for r in range(P):
            while at[r] < len(ops[r]):
                kind, i, c = ops[r][at[r]]
                g = c * P + r
                needs = ("F", i, g - 1) if kind == "F" and g > 0 else ("B", i, g + 1) if kind == "B" and \
                    g < P * v - 1 else None
                if needs is not None and needs not in done:
                    break
                done.add((kind, i, g))
                at[r] += 1
                progress = True
    return all(a == len(o) for a, o in zip(at, ops))


@pytest.mark.parametrize("P,m,v", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (3, 6, 3), (4, 2, 1)])
@pytest.mark.parametrize("extra", [False, True])
def test_schedule_runs_every_micro_batch_once_in_dependency_order(P, m, v, extra):
    assert _runs_to_the_end(P, m, v, extra)
    for stage in range(P):
        ops = schedule(P, stage, m, v, extra)
        base = schedule(P, stage, m, v)
        if extra:  # one forward more before the first backward, the backwards in the same order
            first_b = next(k for k, op in enumerate(ops) if op[0] == "B")
            assert first_b == min(next(k for k, op in enumerate(base) if op[0] == "B") + 1, m * v)
            assert [op for op in ops if op[0] == "B"] == [op for op in base if op[0] == "B"]
        forwards = [(i, c) for kind, i, c in ops if kind == "F"]
        backwards = [(i, c) for kind, i, c in ops if kind == "B"]
        assert sorted(forwards) == sorted(backwards) == sorted((i, c) for i in range(m) for c in range(v))
        for i, c in backwards:
            assert ops.index(("F", i, c)) < ops.index(("B", i, c))
        in_flight = max(sum(1 for kind, *_ in ops[:k + 1] if kind == "F") - sum(1 for kind, *_ in ops[:k + 1]
                        if kind == "B") for k in range(len(ops)))
        if v == 1:  # 1F1B: stage s holds at most P - s micro-batches (one more with the extra warm-up)
            assert in_flight <= min(P - stage + int(extra), m)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps \(3\) to be a multiple of the pipeline size"):
        schedule(2, 0, 3, 2)
