"""Tiled MLP and tiled loss (``zeroplus/activations/tiled.py``, ``tiled_loss.py``): the same values and
gradients as untiled, and no intermediate wider than one tile, on zeroplus's GPT and Hugging Face models.

Tolerances (fp32): outputs and input gradients relative 1e-6 of their largest value (each row's
arithmetic is the untiled one, but the CPU matmul kernel's result for a row depends on how many rows
it gets: equal to the last bits, not bitwise here); parameter gradients and the loss relative 1e-5
(sums over tiles instead of over all rows)."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch
import transformers
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zeroplus
from tests import hf_models
from tests.dist_helper import rank_and_world, run_distributed
from zeroplus.activations.grad_rows import offer_rows, rows_sink
from zeroplus.activations.linear_cross_entropy import SLICE_FRACTION, linear_cross_entropy_sum, vocab_slice
from zeroplus.activations.tiled import cross_entropy_sum, head_function, tile_module, tiled, tiled_cross_entropy
from zeroplus.activations.tiled_loss import tile_hf_causal_lm
from zeroplus.config import ConfigError
from zeroplus.models import GPT, gpt_config


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max())


class _Widest(TorchDispatchMode):
    """The largest number of elements of any tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.widest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.widest = max(self.widest, t.numel())
        return out


class _LiveBytes(TorchDispatchMode):
    """The peak bytes of the storages operators return, alive at once (a storage counted from the first
    tensor returned on it until the last such tensor is freed; ``before``'s storages not counted)."""

    def __init__(self, *before: torch.Tensor) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in before}
        self.users: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.tracked: dict[int, weakref.ref] = {}
        self.live = self.peak = 0

    def _freed(self, ptr: int) -> None:
        self.users[ptr] -= 1
        if not self.users[ptr]:
            del self.users[ptr]
            self.live -= self.sizes.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or (id(t) in self.tracked and self.tracked[id(t)]() is t):
                continue  # (an in-place operator returns its input)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.known:
                continue
            self.tracked[id(t)] = weakref.ref(t)
            if ptr not in self.users:
                self.users[ptr], self.sizes[ptr] = 0, storage.nbytes()
                self.live += storage.nbytes()
            self.users[ptr] += 1
            weakref.finalize(t, self._freed, ptr)
        self.peak = max(self.peak, self.live)
        return out


def _check_grads(tiled_module: nn.Module, plain: nn.Module, rel: float = 1e-5) -> None:
    for (name, p), (_, q) in zip(tiled_module.named_parameters(), plain.named_parameters()):
        assert p.grad is not None and _close(p.grad, q.grad, rel), name


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_tiled_mlp_matches_untiled(family):
    """GPT's MLP (4d, GELU) and Llama's gated MLP, 2 x 37 tokens in tiles of 10 (the last one short)."""
    torch.manual_seed(0)
    mlp = GPT(gpt_config("tiny")).blocks[0].mlp if family == "gpt" else hf_models.build("llama").model.layers[0].mlp
    plain = copy.deepcopy(mlp)
    tile_module(mlp, 10)
    x = torch.randn(2, 37, 64, requires_grad=True)
    x0 = x.detach().clone().requires_grad_()
    y, y0 = mlp(x), plain(x0)
    assert _close(y, y0, 1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    assert _close(x.grad, x0.grad, 1e-6)
    _check_grads(mlp, plain)
    assert [n for n, _ in mlp.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names unchanged


def test_tiled_mlp_holds_one_tile_of_the_intermediate():
    """The 4d-wide intermediate exists for one tile at a time, forward and backward."""
    torch.manual_seed(0)
    mlp = GPT(gpt_config("tiny")).blocks[0].mlp
    x = torch.randn(1, 64, 64, requires_grad=True)
    widths = {}
    for tile in (64, 8):
        tile_module(mlp, tile)
        with _Widest() as seen:
            mlp(x).sum().backward()
        widths[tile] = seen.widest
    assert widths[64] == 64 * 256 and widths[8] == max(8 * 256, 256 * 64)  # (the weight gradient: 4d x d)


def test_tiled_cross_entropy_matches_and_never_forms_the_logits():
    torch.manual_seed(0)
    head = nn.Linear(64, 300, bias=False)
    plain = copy.deepcopy(head)
    h = torch.randn(2, 37, 64, requires_grad=True)
    h0 = h.detach().clone().requires_grad_()
    targets = torch.randint(0, 300, (2, 37))
    targets[0, :5] = -100
    with _Widest() as seen:
        loss = tiled_cross_entropy(head, h, targets, 8)
        loss.backward()
    ref = nn.functional.cross_entropy(plain(h0).float().view(-1, 300), targets.view(-1))
    ref.backward()
    assert _close(loss, ref, 1e-5)
    assert _close(h.grad, h0.grad, 1e-6)
    _check_grads(head, plain)
    assert seen.widest == 300 * 64  # the weight's gradient; logits at most 8 x 300, never 74 x 300


def _loss_peak(loss_fn, head: nn.Module, h: torch.Tensor) -> int:
    with _LiveBytes(head.weight, h) as seen:
        loss_fn().backward()
    head.zero_grad(set_to_none=True)
    return seen.peak


def test_tiled_loss_of_a_linear_head_holds_one_tile_of_logits():
    """A plain ``nn.Linear`` head: at most one tile's fp32 logits (which become its probabilities and its
    gradient in place) beside the head's and the rows' gradients and one vocabulary slice of the head's
    gradient (an eighth of a tile), at once, forward and backward; the generic tiling of
    ``F.cross_entropy`` holds 3.5 tiles' worth, untiled everything (about 12 tiles here)."""
    torch.manual_seed(0)
    vocab, d, rows, tile = 20000, 64, 512, 128
    head = nn.Linear(d, vocab, bias=False)
    h = torch.randn(rows, d, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    one_tile, grads = 4 * tile * vocab, 4 * vocab * d + 4 * rows * d  # the head's and the rows' gradients
    fused = _loss_peak(lambda: tiled_cross_entropy(head, h, targets, tile), head, h)
    fn, params = head_function(head)
    generic = _loss_peak(lambda: tiled(cross_entropy_sum(fn), h, params, tile, extras=(targets,), summed=True),
                         head, h)
    untiled = _loss_peak(lambda: nn.functional.cross_entropy(head(h), targets, reduction="sum"), head, h)
    assert one_tile + grads <= fused <= 1.01 * (one_tile * (1 + 1 / SLICE_FRACTION) + grads), fused / one_tile
    assert generic >= 3.4 * one_tile and untiled >= 4 * rows * vocab * 2


class _FlatBuffer:
    """An engine's flat gradient buffer for one head weight, receiving its gradient by rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.grad = torch.zeros_like(weight)
        self.slices: list[tuple[int, int, bool]] = []

    def __call__(self, start: int, rows: torch.Tensor, last: bool) -> None:
        self.grad[start:start + rows.shape[0]] += rows
        self.slices.append((start, rows.shape[0], last))


def test_tiled_loss_hands_the_head_gradient_by_vocabulary_slices_and_never_holds_it_whole():
    """With a sink offered for the head's weight (the engine's, ``grad_rows.py``), the head's gradient
    arrives slice by slice, in order, the last one flagged, and equals the plain loss's (fp32, 1e-5); the
    weight gets no gradient of its own; the backward's peak is one tile's logits, the rows' gradient and
    one slice (an eighth of a tile) beside the buffer: the head's whole gradient (here a quarter of a
    tile) is never formed."""
    torch.manual_seed(0)
    vocab, d, rows, tile = 20000, 64, 512, 128
    head = nn.Linear(d, vocab, bias=False)
    plain = copy.deepcopy(head)
    h = torch.randn(rows, d, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    sink = _FlatBuffer(head.weight)
    offer_rows(head.weight, sink)
    with _LiveBytes(head.weight, h, sink.grad) as seen:
        tiled_cross_entropy(head, h, targets, tile).backward()
    nn.functional.cross_entropy(plain(h.detach()), targets).backward()
    step = vocab_slice(vocab, d, tile)[0]
    assert sink.slices == [(v, min(step, vocab - v), v + step >= vocab) for v in range(0, vocab, step)]
    assert head.weight.grad is None and _close(sink.grad, plain.weight.grad, 1e-5)
    one_tile = 4 * tile * vocab
    assert seen.peak <= 1.01 * (one_tile * (1 + 1 / SLICE_FRACTION) + 4 * rows * d), seen.peak / one_tile
    del sink
    assert rows_sink(head.weight) is None  # the registry holds the sink weakly: gone with its owner


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.bfloat16, False)])
def test_linear_cross_entropy_matches_cross_entropy(dtype, bias):
    """The fused tiled loss of a linear head against ``F.cross_entropy`` on the whole logits, with a bias,
    ignored targets and a gradient other than 1: fp32 loss and weight/bias gradients within 1e-5 of
    their largest value, rows' gradient (summed over vocabulary slices) within 1e-6; bf16 (per-tile weight
    gradients summed in fp32, rounded once, against one bf16 matmul over all rows) within 1e-2."""
    torch.manual_seed(0)
    head = nn.Linear(32, 300, bias=bias).to(dtype)
    plain = copy.deepcopy(head)
    h = torch.randn(45, 32, dtype=dtype, requires_grad=True)
    h0 = h.detach().clone().requires_grad_()
    targets = torch.randint(0, 300, (45,))
    targets[3:9] = -100
    loss = linear_cross_entropy_sum(h, head.weight, head.bias, targets, 8)
    ref = nn.functional.cross_entropy(plain(h0).float(), targets, reduction="sum")
    (loss * 0.37).backward()
    (ref * 0.37).backward()
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    assert _close(loss, ref, rel)
    assert _close(h.grad.float(), h0.grad.float(), 1e-6 if dtype == torch.float32 else rel)
    for p, q in zip(head.parameters(), plain.parameters()):
        assert p.grad.dtype == dtype and _close(p.grad.float(), q.grad.float(), rel)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_hf_causal_lm_tiled_loss_matches_its_own(family):
    """The model's own loss (shifted labels, -100 ignored, ``num_items_in_batch`` as the Trainer passes it;
    Mixtral with its router loss) and every parameter's gradient, with the loss tiled over 7 tokens."""
    torch.manual_seed(0)
    model = hf_models.build(family)
    if family == "mixtral":
        model.config.output_router_logits = True
    model.eval()  # (GPT-2's dropout would draw differently in the two models)
    plain = copy.deepcopy(model)
    tile_hf_causal_lm(model, 7)
    ids = torch.randint(0, 256, (2, 24))
    labels = ids.clone()
    labels[1, :4] = -100
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(40)}):
        model.zero_grad()
        plain.zero_grad()
        out, ref = model(ids, labels=labels, **kwargs), plain(ids, labels=labels, **kwargs)
        assert out.logits is None and _close(out.loss, ref.loss, 1e-5), (out.loss, ref.loss)
        out.loss.backward()
        ref.loss.backward()
        _check_grads(model, plain, 1e-4 if family == "mixtral" else 1e-5)
    assert model(ids).logits.shape == (2, 24, 256)  # without labels: the model's own forward


def _engine_losses(family: str, stage: int, tiled: bool, accumulation: int = 1) -> list[float]:
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny")) if family == "gpt" else hf_models.build(family)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "gradient_accumulation_steps": accumulation,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False,
                        **({"tiled": {"mlp_tokens": 8, "loss_tokens": 8}} if tiled else {})}}
    engine = zeroplus.initialize(model, cfg)
    mlps = [m for m in model.modules() if type(m).__name__ in ("MLP", "LlamaMLP")]
    assert mlps and all(("_zeroplus_tiled" in vars(m)) == tiled for m in mlps)
    loss_tiles = model.config.loss_tile_tokens if family == "gpt" else vars(model).get("_zeroplus_loss_tiles", 0)
    assert loss_tiles == (8 if tiled else 0)
    losses = []
    for step in range(3 * accumulation):
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(step + 100 * rank_and_world()[0]))
        loss = engine(ids, ids) if family == "gpt" else engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _both(family: str, stage: int, accumulation: int) -> tuple[list[float], list[float]]:
    return _engine_losses(family, stage, False, accumulation), _engine_losses(family, stage, True, accumulation)


@pytest.mark.parametrize("family,stage,accumulation", [("gpt", 1, 1), ("gpt", 3, 1), ("llama", 3, 1),
                                                       ("llama", 1, 2)])
def test_engine_with_tiled_config_follows_the_untiled_run(family, stage, accumulation):
    """``zeroplus.tiled`` in the config, 2 ranks: the tiled run's losses follow the untiled one's over 3
    steps within 1e-5 relative (the head's gradient reaches the flat buffer by vocabulary slices, the
    tied GPT head's once, summed over the tiles, at stage 3 as at stage 1; with micro-batches
    accumulated, the second micro-batch's slices added to the first's)."""
    for untiled, tiled_run in run_distributed(_both, 2, family, stage, accumulation):
        assert torch.allclose(torch.tensor(tiled_run), torch.tensor(untiled), rtol=1e-5, atol=0), (tiled_run, untiled)


class _LargeOutputs(TorchDispatchMode):
    """The shapes of operator outputs of at least ``elements`` elements that are not views (new memory)."""

    def __init__(self, elements: int) -> None:
        super().__init__()
        self.elements, self.shapes = elements, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place result
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.elements:
                self.shapes.append(tuple(t.shape))
        return out


def _head_gradient_shapes(family: str, stage: int) -> list[tuple[int, ...]]:
    """Shapes of every tensor of at least the head's size made during a tiled backward (vocabulary 1000,
    d 64: larger than any other parameter)."""
    torch.manual_seed(0)
    if family == "gpt":
        model = GPT(gpt_config("tiny", vocab_size=1000))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="sdpa"))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zeroplus": {"log_level": "warning", "memory_estimate": False, "tiled": {"loss_tokens": 8}}}
    engine = zeroplus.initialize(model, cfg)
    shapes = []
    for step in range(2):
        ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(step + 100 * rank_and_world()[0]))
        loss = engine(ids, ids) if family == "gpt" else engine(input_ids=ids, labels=ids).loss
        with _LargeOutputs(1000 * 64) as seen:
            engine.backward(loss)
        engine.step()
        shapes += seen.shapes
    return shapes


@pytest.mark.parametrize("family,stage", [("gpt", 1), ("llama", 3)])
def test_engine_takes_the_tiled_head_gradient_by_slices(family, stage):
    """Under the engine (2 ranks) the tiled loss hands the head's gradient to the flat gradient buffer one
    vocabulary slice at a time: in backward, nothing of the head's size or more is made but 1-D flat
    buffers (the head's whole ``(V, d)`` gradient, tied to the embedding or not, never exists). The values
    are proven by ``test_engine_with_tiled_config_follows_the_untiled_run``."""
    for shapes in run_distributed(_head_gradient_shapes, 2, family, stage):
        assert shapes and all(len(s) == 1 for s in shapes), shapes


def test_tiled_config_refuses_what_it_cannot_tile():
    net = nn.Sequential(nn.Linear(8, 8))
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=r"zeroplus.tiled.loss_tokens.*Sequential is neither"):
        zeroplus.initialize(net, {**base, "zeroplus": {"tiled": {"loss_tokens": 8}}})
    with pytest.raises(ConfigError, match=r"zeroplus.tiled.mlp_tokens' matches no module of Sequential"):
        zeroplus.initialize(net, {**base, "zeroplus": {"tiled": {"mlp_tokens": 8}}})
    with pytest.raises(ConfigError, match=r"zeroplus.tiled.mlp_tokens"):
        zeroplus.initialize(net, {**base, "zeroplus": {"tiled": {"mlp_tokens": 0}}})
