"""qwZ (ZeRO++'s quantized weights, ``zero_optimization.zero_quantized_weights``): stage 3's training gathers carry
int8 codes and an fp32 scale per 256 elements (``zero/quantized_comm.py``; see note: qwz).

The quantizer: codes within [-127, 127], the padding's codes 0, an all-zero block's scale 1, and every dequantized
value within ``max |block| / 254`` of the value quantized. Two gloo ranks, the tiny GPT at stage 3 in fp32, three
steps against the same run unquantized: the weights a block computes with in a forward are the same on both ranks and
within that bound of the exact values block by block of each rank's shard (and not all exact); the losses stay within
1% of the unquantized run's; ``state_dict()`` still reads the exact masters (the first block, gathered ahead with
codes after the step, is gathered again exactly); every parameter gather a step sends codes and scales (1.016 bytes
an element against 4, whole blocks of 256 a rank), to the byte; the estimate predicts the
``param_gathered`` and ``comm_buffer`` peaks as the ledger measures them. Stage 2 with the key is refused on every rank.

The other codes (``zeroplus.quantized_weights_dtype``), the same run against the same unquantized one: bf16 gathers the
exact values rounded to nearest bf16, bit for bit; fp8 each rank's shard as ``kernels/block_fp8.py`` quantizes it in
blocks of 128 from the shard's start, bit for bit, every weight within ``|w| / 16`` plus ``1 / 1024`` of its block's
scale; the losses within 1%, ``state_dict()`` exact, the bytes a step (2, and 1 + 4 / 128 whole blocks a rank, an
element) to the byte, the two categories predicted exactly.
"""
from __future__ import annotations

import torch

import zeroplus
from tests.dist_helper import rank_and_world, run_distributed
from tests.reference import initialize_says
from zeroplus.kernels import block_fp8
from zeroplus.ledger import Category
from zeroplus.models.gpt import GPT, gpt_config
from zeroplus.zero import quantized_comm
from zeroplus.zero.quantized_comm import BLOCK

STEPS, MICRO, SEQ = 3, 2, 32


def test_the_quantizer_keeps_every_value_within_half_a_step_of_its_block():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5 * BLOCK + 37, generator=g) * torch.logspace(-3, 2, 5 * BLOCK + 37)
    values[BLOCK:2 * BLOCK] = 0.0  # an all-zero block
    count = quantized_comm.blocks(values.numel())
    codes, scales = torch.empty(count * BLOCK, dtype=torch.int8), torch.empty(count)
    quantized_comm.quantize(values, codes, scales)
    back = torch.empty_like(values)
    quantized_comm.dequantize(codes, scales, back)
    assert count == 6 and codes.abs().max() <= 127 and not codes[values.numel():].any()
    assert scales[1] == 1.0 and not codes[BLOCK:2 * BLOCK].any()
    padded = torch.zeros(count * BLOCK)
    padded[:values.numel()] = values
    bound = padded.view(count, BLOCK).abs().amax(1).repeat_interleave(BLOCK)[:values.numel()] / 254
    assert ((back - values).abs() <= bound * (1 + 1e-6)).all()
    assert (back != values).any()


def _config(quantized: bool, stage: int = 3, dtype: str = "int8") -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "zero_quantized_weights": quantized,
                                  "stage3_param_persistence_threshold": 0},
            "comms_logger": {"enabled": True},
            "zeroplus": {"log_level": "warning", "memory_estimate": True, "quantized_weights_dtype": dtype}}


def _run(quantized: bool, dtype: str = "int8") -> dict:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny"))
    engine = zeroplus.initialize(model, _config(quantized, dtype=dtype))
    block = engine.partition.units[0]
    seen: list[torch.Tensor] = []
    hook = block.module.register_forward_pre_hook(  # (after the engine's: the unit is gathered)
        lambda *_: seen.append(torch.cat([g._full_data.clone() for g in block.groups])) if not seen else None)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 256, (MICRO, SEQ), generator=g)
        loss = engine(ids, ids)
        if step == 0:
            exact = torch.cat([g.gather_owned(g.master_store.read(0, g.owned_numel)) for g in block.groups])
            shards = [(g.padded_numel, g.shard_numel) for g in block.groups]
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            engine.comms_log.reset()
    hook.remove()
    gathered = engine.comms_log.bytes_by_kind("data").get("all_gather", 0)  # (before the reads below gather)
    masters = engine.consolidated_fp32_state()
    state = {k: v for k, v in engine.module.state_dict().items() if k in masters}
    assert engine.budget is not None
    passes = [(1 if u.is_root else 2, g.padded_numel, g.shard_numel) for u in engine.partition.units
              for g in u.all_groups]  # (gathers a step: a block's forward and backward, the root's once)
    result = {"losses": losses, "seen": seen[0], "exact": exact, "shards": shards, "world": world, "passes": passes,
              "state_exact": all(torch.equal(state[k], masters[k]) for k in state) and bool(state),
              "gathered": gathered,
              "predicted": {c: (engine.ledger.peak_bytes(Category(c)), engine.budget.category_peaks[c])
                            for c in ("param_gathered", "comm_buffer")}}
    engine.destroy()
    return result


def _both() -> list[dict]:
    return [_run(False), _run(True)]


def _bound(exact: torch.Tensor, shards: list[tuple[int, int]], world: int) -> torch.Tensor:
    """Half a quantization step for each element of the groups' concatenated values: the largest magnitude of its
    block of 256 within its rank's shard, over 254."""
    out, at = [], 0
    for padded, shard in shards:
        values = torch.zeros(padded)
        values[:min(padded, exact.numel() - at)] = exact[at:at + padded]
        count = quantized_comm.blocks(shard)
        per_rank = torch.zeros(world, count * BLOCK)
        per_rank[:, :shard] = values.view(world, shard)
        amax = per_rank.view(world, count, BLOCK).abs().amax(2).repeat_interleave(BLOCK, dim=1)[:, :shard]
        out.append(amax.reshape(-1)[:padded] / 254)
        at += padded
    return torch.cat(out)


def test_qwz_gathers_int8_codes_and_trains_within_the_quantizers_bound():
    results = run_distributed(_both, 2)
    for rank, (plain, qwz) in enumerate(results):
        exact, seen = qwz["exact"], qwz["seen"]
        assert torch.equal(plain["seen"][:exact.numel()], exact), rank  # (unquantized: the exact values)
        padded = torch.cat([torch.cat([exact, torch.zeros(seen.numel() - exact.numel())])])
        error = (seen - padded).abs()
        assert (error <= _bound(exact, qwz["shards"], qwz["world"]) * (1 + 1e-6)).all(), (rank, error.max())
        assert error.max() > 0, rank
        assert torch.equal(seen, results[0][1]["seen"]), rank  # every rank computes with the same weights
        for a, b in zip(qwz["losses"], plain["losses"]):
            assert abs(a - b) <= 0.01 * abs(b), (rank, qwz["losses"], plain["losses"])
        assert qwz["state_exact"] and plain["state_exact"], rank
        # every parameter gather a step sends codes and scales, whole blocks a rank, instead of 4 bytes an element
        # (the rest, the embedding's gradient rows, is the same in both runs)
        saved = sum(n * (4 * padded - qwz["world"] * quantized_comm.blocks(shard) * (BLOCK + 4))
                    for n, padded, shard in qwz["passes"])
        assert plain["gathered"] - qwz["gathered"] == (STEPS - 1) * saved, (rank, qwz["gathered"], plain["gathered"])
        for result in (plain, qwz):
            assert all(measured == predicted for measured, predicted in result["predicted"].values()), \
                (rank, result["predicted"])


def _formats() -> list[dict]:
    return [_run(False), _run(True, "bf16"), _run(True, "fp8")]


def _fp8_reference(exact: torch.Tensor, shards: list[tuple[int, int]], world: int) -> tuple[torch.Tensor, ...]:
    """The values every rank computes with under fp8 codes (each rank's shard quantized in blocks of 128 from its
    start), and each element's block scale."""
    values, scales, at = [], [], 0
    for padded, shard in shards:
        whole = torch.zeros(padded)
        whole[:min(padded, exact.numel() - at)] = exact[at:at + padded]
        for r in range(world):
            part = whole[r * shard:(r + 1) * shard]
            codes = torch.empty(shard, dtype=block_fp8.E4M3)
            scale = torch.empty(block_fp8.blocks(shard, quantized_comm.FP8_BLOCK))
            block_fp8.quantize(part.clone(), codes, scale, quantized_comm.FP8_BLOCK)
            values.append(block_fp8.dequantize_into(torch.empty(shard), codes, scale, quantized_comm.FP8_BLOCK))
            scales.append(scale.repeat_interleave(quantized_comm.FP8_BLOCK)[:shard])
        at += padded
    return torch.cat(values), torch.cat(scales)


def test_qwz_in_bf16_and_fp8_gathers_the_rounded_shards_bit_for_bit():
    results = run_distributed(_formats, 2)
    for rank, (plain, bf16, fp8) in enumerate(results):
        exact = bf16["exact"]
        padded = torch.cat([exact, torch.zeros(bf16["seen"].numel() - exact.numel())])
        assert torch.equal(bf16["seen"], padded.bfloat16().float()), rank
        expected, scales = _fp8_reference(exact, fp8["shards"], fp8["world"])
        assert torch.equal(fp8["seen"], expected), rank
        assert ((fp8["seen"] - padded).abs() <= padded.abs() / 16 + scales / 1024).all(), rank
        for run, bytes_an_element in ((bf16, lambda shard: 2 * shard),
                                      (fp8, lambda shard: shard + 4 * block_fp8.blocks(shard, 128))):
            assert (run["seen"] != padded).any(), rank
            assert torch.equal(run["seen"], results[0][[plain, bf16, fp8].index(run)]["seen"]), rank
            for a, b in zip(run["losses"], plain["losses"]):
                assert abs(a - b) <= 0.01 * abs(b), (rank, run["losses"], plain["losses"])
            assert run["state_exact"], rank
            saved = sum(n * (4 * padded_numel - run["world"] * bytes_an_element(shard))
                        for n, padded_numel, shard in run["passes"])
            assert plain["gathered"] - run["gathered"] == (STEPS - 1) * saved, (rank, run["gathered"])
            assert all(measured == predicted for measured, predicted in run["predicted"].values()), \
                (rank, run["predicted"])


def _refused() -> str:
    return initialize_says(lambda: GPT(gpt_config("tiny")), [_config(True, stage=2)])[0]


def test_qwz_below_stage_3_is_refused_on_every_rank():
    for rank, said in enumerate(run_distributed(_refused, 2)):
        assert "zero_quantized_weights" in said and "stage 2 gathers no parameters" in said and f"rank {rank}" in said
