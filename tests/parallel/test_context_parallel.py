"""Context parallelism, Ulysses (``zeroplus/parallel/context.py``), on real gloo ranks: each rank of a
context group holds 1/C of every sequence and attention sees it whole through two all-to-alls.

Against the single-process model (the plain module on the whole global batch, ``torch.optim.SGD`` with
momentum, float64 global-norm clipping): every step's loss (the mean of the context ranks' means, equal
token counts) and the final parameters agree within fp32 tolerance (relative 1e-5, with an absolute
floor of 1e-5 times each tensor's largest value: the attention sums and the gradient reductions run in
another order), at ZeRO 1-3, context 2 and 4, and data x context 2 x 2. SGD, not Adam: Adam divides
each gradient by its own magnitude, so an element whose gradient is zero up to rounding (the key
bias: softmax ignores a shift of all scores) moves by rounding noise amplified to a step of lr."""
from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import zeroplus
from tests import hf_models
from tests.dist_helper import rank_and_world, run_distributed
from tests.parallel.model_states import assert_model_states_predicted, ledger_peaks
from tests.reference import clip_global_norm
from tests.saved_bytes import PeakOfNewStorages, saved_in_real_step
from zeroplus.budget.virtual_group import VirtualGroup
from zeroplus.comm import DataParallelGroup
from zeroplus.config import ConfigError, parse_config
from zeroplus.models import GPT, gpt_config
from zeroplus.parallel.context import check_heads, heads_to_seq, seq_to_heads
from zeroplus.parallel.groups import parallel_groups
from zeroplus.parallel.ring_attention import ring_attention, windowed_attention, zigzag_slice
from zeroplus.parallel.topology import KINDS, Topology
from zeroplus.parallel.ulysses_output import output_exchanged

STEPS, MICRO, SEQ, LR, CLIP = 3, 2, 32, 0.1, 1.0


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", n_head=4, block_size=SEQ))


def _batches(data_ranks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step s, data rank d: batch ``s * D + d`` (what ``reference_train`` expects)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS * data_ranks):
        ids = torch.randint(0, 256, (MICRO, SEQ), generator=g)
        out.append((ids, ids.roll(-1, dims=1)))
    return out


class _RowsOfWidth(TorchDispatchMode):
    """The most rows of any new operator output (not a view; not on the meta device, where the engine's
    first forward predicts its memory) whose last dimension is ``width`` (a tile's logits, ``(t, V)``, or
    its MLP intermediate)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.rows = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.dim() >= 2 and t.shape[-1] == self.width:
                self.rows = max(self.rows, t.numel() // self.width)
        return out


def _tiles(tokens: int | None) -> dict:
    return {} if tokens is None else {"tiled": {"mlp_tokens": tokens, "loss_tokens": tokens}}


def _train(stage: int, context: int, mode: str = "ulysses", tile: int | None = None, ulysses: int = 1) -> dict:
    """``tile``: ``zeroplus.tiled`` MLP and loss tiles of that many tokens (of the whole sequence); the
    result's ``tile_rows`` is the most rows of a logits block or MLP intermediate (width 256 in this GPT)
    made in a forward."""
    rank, world = rank_and_world()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "parallel": {"context": context, "context_mode": mode,
                                                             "ulysses_size": ulysses}, **_tiles(tile)}}
    engine = zeroplus.initialize(_model(), cfg)
    groups = parallel_groups()
    data_ranks, d = groups.topology.data, groups.coordinates.data
    batches = _batches(data_ranks)
    losses = []
    widest = _RowsOfWidth(engine.module.config.vocab_size)
    for s in range(STEPS):
        x, y = batches[s * data_ranks + d]  # every rank of a context group: the same whole sequences
        with widest:
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        local = loss.detach().clone()
        torch.distributed.all_reduce(local)  # the mean over the zero group's local means
        losses.append(local.item() / world)
    return {"losses": losses, "state": engine.consolidated_fp32_state(), "zero": engine.dp.size,
            "data": data_ranks, "tile_rows": widest.rows}


def _reference(data_ranks: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain model on the whole global batch: each step's mean loss and the final parameters."""
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)
    batches = _batches(data_ranks)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for d in range(data_ranks):
            loss = model(*batches[s * data_ranks + d])
            (loss / data_ranks).backward()
            total += loss.item() / data_ranks
        losses.append(total)
        clip_global_norm(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(results: list[dict], data_ranks: int) -> None:
    ref_losses, ref_state = _reference(data_ranks)
    for r in results:
        assert r["data"] == data_ranks
        assert torch.allclose(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0), \
            (r["losses"], ref_losses)
        for name, value in r["state"].items():
            ref = ref_state[name]
            floor = 1e-5 * ref.abs().max().item()
            torch.testing.assert_close(value, ref, rtol=1e-5, atol=floor, msg=name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ulysses_context_2_matches_the_single_process_model(stage):
    results = run_distributed(_train, 2, stage, 2)
    assert all(r["zero"] == 2 for r in results)
    _check(results, 1)


def test_ulysses_context_4_and_data_x_context_2_x_2():
    _check(run_distributed(_train, 4, 3, 4), 1)
    _check(run_distributed(_train, 4, 2, 2), 2)


@pytest.mark.parametrize("stage,world,context", [(1, 2, 2), (3, 2, 2), (2, 4, 4), (3, 4, 2)])
def test_ring_context_matches_the_single_process_model(stage, world, context):
    """``context_mode: "ring"``: the GPT keeps its zigzag chunks (positions global) and runs ring attention."""
    results = run_distributed(_train, world, stage, context, "ring")
    _check(results, world // context)


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_ulysses_2_x_ring_2_matches_the_single_process_model(stage):
    """``context_mode: "hybrid"``, ``ulysses_size`` 2 of context 4: heads over pairs, K/V around rings of 2."""
    _check(run_distributed(_train, 4, stage, 4, "hybrid", None, 2), 1)


def test_hybrid_sizes_are_checked_with_the_numbers():
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    cases = [({"context": 4, "context_mode": "hybrid", "ulysses_size": 3}, "context 4 and ulysses_size 3"),
             ({"context": 4, "context_mode": "hybrid"}, "context 4 and ulysses_size 1"),
             ({"context": 2, "ulysses_size": 2}, "ulysses_size is 2: it splits the context ranks only")]
    for parallel, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_config({**base, "zeroplus": {"parallel": parallel}})


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_tiled_mlp_and_loss_under_context_parallelism_match_the_single_process_model(mode):
    """``zeroplus.tiled`` with context 2: the tiled MLPs and loss run on each rank's part of the sequence and
    the run equals the untiled single-process model's within the same tolerance. A tile counts tokens of
    the whole sequence, so each rank's tile is half of it: no logits block or MLP intermediate has more
    than 8 rows for tiles of 16 tokens (each rank holds 32 of the batch's 64 tokens)."""
    results = run_distributed(_train, 2, 1, 2, mode, 16)
    _check(results, 1)
    assert [r["tile_rows"] for r in results] == [8, 8]


def _round_trip() -> tuple[bool, bool]:
    group = DataParallelGroup(None)
    rank = group.rank
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) + 1000 * rank  # (b, s/C, H, hd)
    heads = seq_to_heads(x, group)  # (b, s, H/C, hd): the whole sequence, this rank's head block
    whole = torch.cat([torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5) + 1000 * r
                       for r in range(group.size)], dim=1)
    block = whole[:, :, rank * 2:(rank + 1) * 2]
    return torch.equal(heads, block), torch.equal(heads_to_seq(heads, group), x)


def test_all_to_alls_turn_a_sequence_split_into_a_head_split_and_back():
    assert all(all(r) for r in run_distributed(_round_trip, 2))


def test_every_group_kind_covers_every_rank_once_with_context():
    for topology in (Topology(4, context=2), Topology(8, context=4), Topology(8, context=2)):
        for kind in KINDS:
            ranks = sorted(r for group in topology.groups(kind) for r in group)
            assert ranks == list(range(topology.world_size)), (topology, kind)
    assert Topology(8, context=2).groups("zero") == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert Topology(8, context=2).groups("context") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_unsupported_combinations_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="context size 2 with tensor size 2 is not supported yet"):
        Topology(4, tensor=2, context=2)
    with pytest.raises(ValueError, match="not divisible by tensor x context x pipeline = 1 x 3 x 1 = 3"):
        Topology(4, context=3)
    with pytest.raises(ValueError, match="6 attention heads are not divisible by context size 4"):
        check_heads(6, VirtualGroup(0, 4))  # (fewer key/value heads than C are repeated instead: the Llama test)


def _resume(path: str, mode: str) -> tuple[float, float]:
    """Two steps and a checkpoint; the engine and a fresh one that loads the checkpoint each take the third step."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3},
           "zeroplus": {"log_level": "warning", "parallel": {"context": 2, "context_mode": mode}}}
    batches = _batches(1)
    engine = zeroplus.initialize(_model(), cfg)
    for s in range(2):
        engine.backward(engine(*batches[s]))
        engine.step()
    engine.save_checkpoint(path)
    again = zeroplus.initialize(_model(), cfg)
    again.load_checkpoint(path)
    out = []
    for run in (engine, again):  # the third step (optimizer states restored too) and the forward after it
        run.backward(run(*batches[2]))
        run.step()
        out.append(run(*batches[0]).item())
    return out[0], out[1]


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_checkpoint_resumes_bit_exactly_under_context_parallelism(tmp_path, mode):
    for continued, resumed in run_distributed(_resume, 2, str(tmp_path), mode):
        assert continued == resumed


def _hf(family: str) -> torch.nn.Module:
    """``mistral-window``: Mistral with a sliding window of 6 positions, shorter than the sequence (32) and than a
    ring chunk (8), so every path must apply it. ``qwen2-window``: Qwen2 with the window on its second layer only
    (``max_window_layers`` 1: a window per layer)."""
    if family == "qwen2-window":
        import transformers as tf
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, use_sliding_window=True, sliding_window=6, max_window_layers=1,
            attn_implementation="sdpa"))
    if family != "mistral-window":
        return hf_models.build(family)
    model = hf_models.build("mistral")
    model.config.sliding_window = 6
    return model


def _llama(mode: str = "ulysses", data_ranks: int = 1, tile: int | None = None, family: str = "llama"
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, world = rank_and_world()
    torch.manual_seed(0)
    model = _hf(family)  # 4 heads, 2 key/value heads (GQA), rotary positions
    hybrid = {"ulysses_size": 2} if mode == "hybrid" else {}
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": CLIP,
           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "parallel": {"context": world // data_ranks, "context_mode": mode,
                                                             **hybrid}, **_tiles(tile)}}
    engine = zeroplus.initialize(model, cfg)
    d = parallel_groups().coordinates.data
    batches = _batches(data_ranks)
    losses = []
    for s in range(STEPS):
        x = batches[s * data_ranks + d][0]  # every rank of a context group: the same whole sequences
        labels = x.clone()
        labels[:, :5] = -100  # ignored tokens, all in context rank 0's slice
        loss = engine(input_ids=x, labels=labels).loss
        engine.backward(loss)
        engine.step()
        local = loss.detach().clone()
        torch.distributed.all_reduce(local)
        losses.append(local.item() / world)
    return losses, engine.consolidated_fp32_state()


HF_CASES = [("ulysses", 2, 1, None, "llama"), ("ring", 2, 1, None, "llama"), ("ulysses", 4, 1, None, "llama"),
            ("ring", 4, 2, None, "llama"), ("ring", 2, 1, 16, "llama"), ("hybrid", 4, 1, None, "llama"),
            ("hybrid", 4, 1, None, "qwen2"), ("ulysses", 2, 1, None, "mistral-window"),
            ("ring", 2, 1, None, "mistral-window"), ("hybrid", 4, 1, None, "mistral-window"),
            ("ring", 2, 1, None, "qwen2-window")]


def _llama_each(cases: list[tuple]) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """``_llama`` for each case in turn in one world (its groups reset between cases)."""
    out = []
    for mode, _, data_ranks, tile, family in cases:
        zeroplus.parallel.reset_parallel()
        out.append(_llama(mode, data_ranks, tile, family))
    return out


def _hf_reference(data_ranks: int, family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain model on the data ranks' batches at once (the same whatever the context layout)."""
    torch.manual_seed(0)
    ref_model = _hf(family)
    params = [p for p in ref_model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.01)
    ref_losses = []
    batches = _batches(data_ranks)
    for s in range(STEPS):
        x = torch.cat([b[0] for b in batches[s * data_ranks:(s + 1) * data_ranks]])
        labels = x.clone()
        labels[:, :5] = -100
        loss = ref_model(input_ids=x, labels=labels).loss
        loss.backward()
        ref_losses.append(loss.item())
        clip_global_norm(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref_state = {n: p.detach() for n, p in ref_model.named_parameters()}
    return ref_losses, ref_state


@pytest.mark.parametrize("world", [2, 4])
def test_hugging_face_llama_with_gqa_rope_and_ignored_labels(world):
    """Llama (grouped-query attention, rotary positions: the positions must be the global ones), ZeRO-3,
    context 2 (and Ulysses at 4, where the 2 key/value heads are repeated to the 4 query heads before
    the exchange; and ring with data x context 2 x 2, the reference taking both data ranks' batches at
    once), labels with 5 ignored tokens per row all in one rank's part: losses and parameters equal
    the single-process model's within fp32 tolerance; and so with ring and ``zeroplus.tiled`` (MLPs and loss
    over tiles of 16 tokens of the sequence, 8 per rank); and ``context_mode: "hybrid"`` at 2 x 2 for Llama and
    Qwen2 (K/V repeated to the query heads, heads over the Ulysses pair, K/V around the ring); and Mistral with a
    sliding window shorter than a ring chunk on every path (dropped before: the loss without the window), and Qwen2
    with a window on one of its two layers. The cases of one world size in turn in one world, each named."""
    cases = [c for c in HF_CASES if c[1] == world]
    results = run_distributed(_llama_each, world, cases)
    references: dict[tuple[int, str], tuple[list[float], dict[str, torch.Tensor]]] = {}
    for i, (mode, _, data_ranks, tile, family) in enumerate(cases):
        label = f"{family} {mode} at {world} ranks, data {data_ranks}, tile {tile}"
        if (data_ranks, family) not in references:
            references[data_ranks, family] = _hf_reference(data_ranks, family)
        ref_losses, ref_state = references[data_ranks, family]
        for rank_results in results:
            losses, state = rank_results[i]
            assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0), \
                (label, losses, ref_losses)
            for name, value in state.items():
                floor = 1e-5 * ref_state[name].abs().max().item()
                torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=floor,
                                           msg=lambda m, n=name: f"{label}, {n}: {m}")


def _predicted_and_measured(stage: int, context: int, mode: str) -> tuple[dict, dict, dict]:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 3000},
           "zeroplus": {"log_level": "warning", "parallel": _parallel(context, mode)}}
    engine = zeroplus.initialize(_model(), cfg)
    d = parallel_groups().coordinates.data
    batches = _batches(parallel_groups().topology.data)
    for s in range(2):
        for _ in range(2):  # (step() after each backward: the optimizer steps at the accumulation boundary)
            engine.backward(engine(*batches[s * parallel_groups().topology.data + d]))
            engine.step()
    rank, world = rank_and_world()
    assert engine.budget is not None, "the engine made no prediction"
    budget = zeroplus.estimate(_model, cfg, world_size=world, rank=rank, seq_len=SEQ)
    return ledger_peaks(engine), engine.budget.category_peaks, budget.category_peaks


def _parallel(context: int, mode: str) -> dict:
    """The parallel block; hybrid: Ulysses pairs (one process, context 1: no split at all)."""
    if mode == "hybrid":
        return {"context": context, "context_mode": mode, "ulysses_size": 2} if context > 1 else {}
    return {"context": context, "context_mode": mode}


@pytest.mark.parametrize("stage,world,context,mode", [(3, 2, 2, "ulysses"), (2, 4, 2, "ulysses"), (3, 2, 2, "ring"),
                                                      (3, 4, 4, "hybrid")])
def test_memory_estimate_covers_context_parallelism(stage, world, context, mode):
    """The engine's prediction at its first forward and ``zeroplus.estimate`` (built on the meta device,
    the context group simulated) give the model-state peaks the ledger measures, under ZeRO over
    data x context."""
    for rank, (measured, engine_predicted, estimated) in enumerate(run_distributed(_predicted_and_measured, world,
                                                                                   stage, context, mode)):
        assert_model_states_predicted(measured, f"rank {rank}, stage {stage}, context {context}",
                                      estimate=estimated, engine=engine_predicted)


def _saved_for_backward(mode: str, context: int, tile: int | None = None) -> tuple[int, int]:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "parallel": _parallel(context, mode), **_tiles(tile)}}
    engine = zeroplus.initialize(_model(), cfg)
    x, y = _batches(1)[0]
    engine.backward(engine(x, y))  # the first forward predicts
    engine.step()
    assert engine.budget is not None, "the engine made no prediction"
    return saved_in_real_step(engine, lambda: engine(x, y)), engine.budget.saved_for_backward


@pytest.mark.parametrize("mode,context,tile", [("ulysses", 2, None), ("ring", 2, None), ("ulysses", 4, None),
                                               ("ring", 2, 16), ("hybrid", 4, None)])
def test_predicted_activations_under_context_parallelism_are_what_autograd_saves(mode, context, tile):
    """The engine's prediction of what one forward saves for backward, per context rank, against the bytes
    autograd saves in the real forward (within 0.5%: the loss and its scalars are alive, not saved), and
    1/C of one process's on the whole sequences within 2% (the tiny GPT: its embeddings' and head's saved
    inputs are per token too): attention keeps one copy of its output, not its own beside the output
    projection's (C = 2: measured 0.502 of one process; 0.527 with two copies), also with one head per
    rank (C = 4), where the exchange back must not leave the caller a strided view to copy again. With
    ``zeroplus.tiled`` (ring, tiles of 16 tokens of the sequence) the same against the tiled single
    process: the tiled MLPs and loss save only their inputs, on each rank its part. ``hybrid`` at 2 x 2 too: the
    ring's saved output is formed again from the one brought home, as Ulysses' is (1.061/C when it kept both)."""
    whole, _ = run_distributed(_saved_for_backward, 1, mode, 1, tile)[0]
    for real, predicted in run_distributed(_saved_for_backward, context, mode, context, tile):
        assert predicted == pytest.approx(real, rel=0.005), (predicted, real)
        assert 0.98 / context * whole < real < 1.02 / context * whole, (real, whole)


def _band(length: int, window: int | None) -> torch.Tensor:
    """Transformers' causal (and sliding-window) mask: query i sees key j when j <= i and i - j < window."""
    i, j = torch.arange(length).unsqueeze(-1), torch.arange(length)
    return (j <= i) & (i - j < window) if window is not None else j <= i


def _ring_vs_whole(block_rows: int | None, window: int | None = None) -> tuple[float, float, float, float]:
    group = DataParallelGroup(None)
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 3, 8 * group.size, 8, generator=g) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*whole, attn_mask=_band(8 * group.size, window))
    ref.backward(dout)
    mine = [zigzag_slice(t, group, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, group, block_rows=block_rows, window=window)
    out.backward(zigzag_slice(dout, group, dim=2))

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - zigzag_slice(b, group, dim=2)).abs().max() / b.abs().max())
    return (err(out.detach(), ref.detach()),) + tuple(err(m.grad, w.grad) for m, w in zip(mine, whole))


@pytest.mark.parametrize("world,block_rows,window", [(2, None, None), (2, 3, None), (4, 1, None), (2, None, 5),
                                                     (4, 3, 5), (4, None, 11), (2, 3, 2)])
def test_ring_attention_equals_whole_causal_attention(world, block_rows, window):
    """Zigzag-split queries, keys and values on C ranks; the output and the gradients of Q, K and V equal
    torch's causal attention over the whole sequence, each within 1e-5 of its largest value; also with
    each chunk pair cut into blocks of 3 query rows (the last block short) or 1 row; and with a sliding window
    (2, 5 and 11 positions over chunks of 4 tokens), where key chunks wholly outside the
    window are skipped and rows with no key in a block add nothing."""
    for errors in run_distributed(_ring_vs_whole, world, block_rows, window):
        assert max(errors) < 1e-5, errors


def test_windowed_attention_on_one_rank_equals_the_masked_whole():
    """Ulysses' path for a sliding window: the whole sequence of its heads on one rank, by the ring's blocks."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 3, 24, 8, generator=g) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*whole, attn_mask=_band(24, 7))
    ref.backward(dout)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = windowed_attention(*mine, None, 7)
    out.backward(dout)
    for a, b in [(out, ref)] + [(m.grad, w.grad) for m, w in zip(mine, whole)]:
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def _ring_backward_peak() -> float:
    group = DataParallelGroup(None)
    g = torch.Generator().manual_seed(group.rank)
    length, heads, dim = 512, 2, 64  # this rank's tokens; a unit is b h L d fp32 = 256 KiB
    q, k, v = (torch.randn(1, length, heads, dim, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))
    out = ring_attention(q, k, v, group, block_rows=8)  # score blocks of 2 x 8 x 256: 1/16 of a unit
    dout = torch.randn_like(out)
    with PeakOfNewStorages() as mode:
        out.backward(dout)
    return mode.peak / (length * heads * dim * 4)


@pytest.mark.parametrize("world,units", [(2, 6.2), (4, 8.2)])
def test_ring_backward_holds_dq_two_kv_blocks_and_three_half_pairs(world, units):
    """Ring backward beside its inputs, in units of ``b h L d`` fp32: dQ (1), the K/V block computed on and
    the one arriving (2 + 2, at C = 2 the own block is not a copy and nothing arrives at the last step),
    the dK/dV sums of three key chunks (3: computing, leaving, arriving), the returned dK and dV (2, at the
    end, in place of the blocks) and score blocks (0.1). Before the sums travelled by key chunk, one transfer at
    a time, and each step's temporaries were released before the next transfer, C = 4 held 13.1 units here
    and C = 2 9.6."""
    for peak in run_distributed(_ring_backward_peak, world):
        assert peak <= units, (world, peak)


def _output_kept_once() -> tuple[bool, bool, bool, str]:
    group = DataParallelGroup(None)
    g = torch.Generator().manual_seed(5 + group.rank)
    local = [torch.randn(2, 8, 4, 8, generator=g, requires_grad=True) for _ in range(3)]  # (b, s/C, H, hd)
    weight = torch.randn(32, 32, generator=g, requires_grad=True)

    def attention_then_projection(kept_once: bool) -> tuple[list[torch.Tensor], bool]:
        head_output: list[StorageWeakRef] = []

        def attend() -> tuple[torch.Tensor, None]:
            q, k, v = (seq_to_heads(t, group).transpose(1, 2) for t in local)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
            head_output.append(StorageWeakRef(out.untyped_storage()))
            return out, None
        home = output_exchanged(group, attend)[0] if kept_once else heads_to_seq(attend()[0], group)
        loss = (home.reshape(2, 8, 32) @ weight).square().sum()  # the projection saves home
        freed = head_output[0].expired()  # before backward: attention kept no copy of its own
        return [loss.detach(), *torch.autograd.grad(loss, local + [weight])], freed
    ref, ref_freed = attention_then_projection(False)
    got, got_freed = attention_then_projection(True)
    home = output_exchanged(group, lambda: (torch.nn.functional.scaled_dot_product_attention(
        *(seq_to_heads(t, group).transpose(1, 2) for t in local), is_causal=True).transpose(1, 2), None))[0]
    loss = home.sum()  # (saves nothing: only the attention's own saved output can notice the change)
    with torch.no_grad():
        home.mul_(2.0)  # behind autograd's back: the output formed again would not be the one attention made
    try:
        loss.backward()
        error = ""
    except RuntimeError as err:
        error = str(err)
    return all(torch.equal(a, b) for a, b in zip(ref, got)), ref_freed, got_freed, error


def test_ulysses_attention_keeps_one_copy_of_its_output():
    """``output_exchanged``: the loss and the gradients of Q, K, V and the projection are bitwise those of the
    plain exchange; the head-layout output is freed before backward (it is not with the plain exchange); an
    output modified in place before backward makes backward raise, naming the cause."""
    for bitwise, plain_freed, freed, error in run_distributed(_output_kept_once, 2):
        assert bitwise and freed and not plain_freed
        assert "modified in place after the all-to-all" in error, error


def _all_to_all_bytes() -> tuple[int, int]:
    context = zeroplus.init_parallel({"zeroplus": {"parallel": {"context": 2}}}).context
    model = _model()
    x, y = _batches(1)[0]
    context.bytes_sent.clear()
    model(x, y).backward()
    return context.bytes_sent["all_to_all"], context.size


def _hybrid_bytes() -> tuple[int, int, int]:
    groups = zeroplus.init_parallel({"zeroplus": {"parallel": {"context": 4, "context_mode": "hybrid",
                                                               "ulysses_size": 2}}})
    model = _model()
    x, y = _batches(1)[0]
    ulysses, ring = groups.context_ulysses, groups.context_ring
    ulysses.bytes_sent.clear()
    ring.bytes_sent.clear()
    model(x, y).backward()
    return ulysses.bytes_sent["all_to_all"], ring.bytes_sent["ring"], sum(ring.bytes_sent.values())


def test_hybrid_sends_the_formula_volume():
    """``hybrid`` at C = U x R = 2 x 2, per layer and micro-batch, in units of ``b s h / C`` elements (a rank's
    share of one activation): over the Ulysses group Q, K, V and the output in forward, their gradients and the
    output once more in backward (9: the ring's saved output formed again from the home copy, as under Ulysses);
    around the ring K and V R - 1 times in forward, R - 1 times again in backward and dK, dV R times
    (2 (R - 1) + 2 (R - 1) + 2 R = 8 at R = 2). Nothing else on either group."""
    b, s, h, layers, c, r = MICRO, SEQ, 64, 2, 4, 2
    unit = b * s * h // c * 4  # fp32
    for a2a, ring, ring_all in run_distributed(_hybrid_bytes, 4):
        assert a2a == layers * 9 * unit, (a2a, unit)
        assert ring == ring_all == layers * (2 * (r - 1) + 2 * (r - 1) + 2 * r) * unit, (ring, ring_all, unit)


def test_ulysses_sends_the_formula_volume():
    """Per layer and micro-batch, forward: Q, K, V and the output, each b * s * h / C elements sent by every
    rank (4 b s h / C); backward: their gradients and the output once more (attention's saved copy of it is
    formed again from the output projection's, ``ulysses_output.py``): 5 b s h / C. Counted on the context
    group's own tally."""
    b, s, h, layers = MICRO, SEQ, 64, 2
    for sent, c in run_distributed(_all_to_all_bytes, 2):
        assert sent == layers * (4 + 5) * b * s * h // c * 4, sent  # (forward and backward, fp32)


def _second_layout() -> tuple[bool, str]:
    ring = {"zeroplus": {"parallel": {"context": 2, "context_mode": "ring"}}}
    groups = zeroplus.init_parallel(ring)
    same = zeroplus.init_parallel(ring) is groups
    with pytest.raises(ValueError) as refused:
        zeroplus.init_parallel({"zeroplus": {"parallel": {"context": 2, "context_mode": "ulysses"}}})
    return same, str(refused.value)


def test_groups_made_for_one_context_layout_refuse_another():
    """Groups exist for context 2 as a ring: the same config gets them again; a config with the same sizes and
    Ulysses is refused (it ran as a ring before), naming both layouts."""
    for same, message in run_distributed(_second_layout, 2):
        assert same
        assert "context_mode 'ring'" in message and "asks for 'ulysses'" in message, message


def _refusals(mode: str) -> list[str]:
    import transformers as tf
    torch.manual_seed(0)
    out = []
    gemma = tf.Gemma2ForCausalLM(tf.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16, attn_logit_softcapping=50.0, sliding_window=8))
    ids = torch.randint(0, 256, (1, SEQ))
    packed = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).unsqueeze(0)  # two sequences in one row
    for model, kwargs in ((gemma, {}), (hf_models.build("llama"), {"position_ids": packed})):
        engine = zeroplus.initialize(model, {
            "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 1},
            "zeroplus": {"log_level": "warning", "memory_estimate": False,
                         "parallel": {"context": 2, "context_mode": mode}}})
        try:
            engine(input_ids=ids, labels=ids, **kwargs)
            out.append("ran")
        except ValueError as err:
            out.append(str(err))
        engine.destroy()
    return out


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_attention_arguments_a_path_does_not_honour_are_refused_at_the_first_forward(mode):
    """Gemma 2's logit softcapping and packed sequences (position ids restarting inside a row) would compute other
    attention than one process: each is refused at the first forward on every rank, naming it."""
    for rank, (softcap, packed) in enumerate(run_distributed(_refusals, 2, mode)):
        assert "softcap" in softcap and "Gemma2Attention" in softcap, f"rank {rank}: {softcap}"
        assert "packed sequences" in packed, f"rank {rank}: {packed}"


def _imported_after_the_launch() -> float:
    import importlib

    from zeroplus.models import gpt
    importlib.reload(gpt)  # (as a script that imports zeroplus after init_process_group has it)
    torch.manual_seed(0)
    model = gpt.GPT(gpt.gpt_config("tiny"))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return model(ids, ids).item()


def test_a_gpt_outside_any_engine_keeps_whole_sequences_on_every_rank():
    # no groups made: the context group is this rank alone, not the launched world (each rank would keep 1/W of the
    # sequence and compute another loss: an FSDP2 or DDP script around the GPT trained on slices)
    first, second = run_distributed(_imported_after_the_launch, 2)
    assert first == second
