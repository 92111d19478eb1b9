"""The planner: the cheapest config that fits a memory budget, chosen from predictions.

Asked for by ``"zeroplus": {"memory_budget": "16GB"}`` with ``"auto"`` in any of
``zero_optimization.stage``, ``zero_optimization.offload_optimizer.ratio``,
``zeroplus.shared_master_weights``, ``zeroplus.resize_recompute.enabled`` and the lossy ones,
``zeroplus.optimizer_states.exp_avg``/``exp_avg_sq`` (bf16 moments) and ``zeroplus.master_weights.dtype``
(bf16 masters) (a budget without ``"auto"`` is a check of the config as written). ``zeroplus.seq_len`` gives
the token length the activations are predicted for (``initialize`` sees no input yet); ``plan()`` also takes
``example_inputs``.

1. Candidates: every combination of the ``"auto"`` keys (stages 0-3; ratio none, 0.25, 0.5,
   0.75, 1 when an offload device is set; shared master weights off/on in bf16; resize
   recompute off/on; bf16 moments off/on for the config's Adam or AdamW; bf16 masters off/on in bf16, not beside
   shared masters or offloaded parameters; over several nodes, MiCS over a node or over several whole nodes, hpZ
   over a node, and qwZ's and qgZ's quantized collectives off/on: ``links``); with ``tensor_parallel.autotp_size``
   or ``expert_parallel.autoep_size`` 'auto', a Hugging Face model's tensor or expert size: 1 and each size that
   divides the ranks and that the model's own plan splits (``autotp.check_plan``, ``autoep.check_experts``), planned
   before any group splits the model (``initialize``).
2. Each gets a cost before anything is simulated, in seconds per optimizer step on a nominal
   machine (``BANDWIDTH``): its collectives' bytes per rank (ring all-reduce 2 c P (N-1)/N;
   reduce-scatter and all-gather c P (N-1)/N each; stages 2-3 reduce every micro-batch, stage 3
   gathers twice per micro-batch), its offloaded optimizer states read and written once per step
   over the tier's bandwidth, and shared master weights' split and merge (8 bytes per owned
   element) over memory bandwidth. Ties go to the candidate with fewer techniques on. A lossy technique (bf16
   moments, bf16 masters) comes after every exact candidate: chosen only where nothing exact fits, and named in
   the plan's reason with its stated accuracy cost (``LOSSY``). The quantized collectives save bytes, not memory:
   left 'auto', they compete on cost (the bytes they save across nodes against their quantizing over memory
   bandwidth) and are named in the reason with their accuracy cost (``QUANTIZED``); on one node they stay off.
   Splits are tried with the fewest ranks splitting the model first (after the lossy order): tensor parallelism's
   all-reduces and expert parallelism's all-to-alls sit on the layers' critical path, where ZeRO's collectives
   overlap compute, so a byte count alone would favour them wrongly at small batches; a split is a way to fit,
   taken where no smaller one fits, its bytes (``autotp.exchanged_per_token``, ``autoep.exchanged_per_token``) in
   its cost and reason (see note: planner tensor size).
3. The most frugal candidate (highest stage and offload ratio, every technique on) is simulated
   first (``estimate.py``): if even it exceeds the budget, nothing fits, and the error names its
   predicted peak, the smallest budget that would fit, with its settings.
4. Otherwise candidates are simulated cheapest first; the first whose predicted peak is within
   the budget is the plan, with the cheaper ones that did not fit named in its reason.

Cost: one simulation per candidate tried (seconds each for a 100M-parameter model), on one
process; ranks hold the same bytes (shards are equal), so every rank reaches the same plan.
See note: planner; see note: planner context (docs/design-notes.md).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any, Callable

import torch

from ..config import ConfigError, ZeroplusConfig, ZeroStage, auto_keys, load_config, parse_bytes
from ..optim.build import resolve_optimizer_class
from ..optim.stored_states import stored_states_class
from ..parallel.autoep import check_experts, experts_modules
from ..parallel.autoep import exchanged_per_token as experts_exchanged
from ..parallel.autotp import check_plan
from ..parallel.autotp import exchanged_per_token as tensor_exchanged
from ..parallel.groups import ranks_per_node, tiling_nodes
from ..parallel.topology import Topology
from ..zero.quantized_comm import BLOCK, FP8_BLOCK
from .estimate import MemoryBudget, estimate

# Nominal bandwidths (bytes/s) the costs are computed with: only their ratios order candidates.
BANDWIDTH = {"comm": 10e9, "nvme": 2e9, "cpu": 10e9, "memory": 50e9}
RATIOS = (0.25, 0.5, 0.75, 1.0)
# what each lossy technique costs in accuracy, as measured (docs/benchmark.md; the main job: GPT small, ZeRO-3 bf16,
# 2 ranks, 300 steps, 2026-12-04)
LOSSY = {"states": "bf16 optimizer states (lossy: the main job's loss within 0.05% of fp32 moments')",
         "masters": "bf16 master weights (lossy: rounded stochastically, the main job's loss within 0.03% of fp32 "
                    "masters'; to nearest +1.6%)"}
# ZeRO++'s quantized collectives, chosen for bytes across nodes, not memory (the main job: GPT small, ZeRO-3 fp32,
# 2 ranks, 300 steps, 2026-12-06; see note: qwz, see note: qgz)
QUANTIZED = {"qw": "qwZ int8 weight gathers (lossy: each weight within max|block| / 254; the main job's loss +0.02%)",
             "qw_fp8": "qwZ fp8 weight gathers (lossy: each weight within |w| / 16 of its block)",
             "qw_bf16": "qwZ bf16 weight gathers (lossy in fp32: each weight within |w| / 256)",
             "qg": "qgZ int8 gradient reductions (lossy: the main job's loss within 0.01%)",
             "qg4": "qgZ int4 gradient reductions (lossy: each rank's part within max|block| / 14)"}


def _coded(bits: int) -> float:
    """Bytes an element as a code of ``bits`` with an fp32 scale per ``BLOCK`` elements (zero/quantized_comm.py)."""
    return bits / 8 + 4 / BLOCK


CODE_BYTES = _coded(8)  # qwZ's int8 codes
# qwZ's, by zeroplus.quantized_weights_dtype
WEIGHT_CODE_BYTES = {"int8": CODE_BYTES, "fp8": 1 + 4 / FP8_BLOCK, "bf16": 2.0}


@dataclasses.dataclass(frozen=True)
class Settings:
    """One candidate: the values the planner chooses."""

    stage: int
    ratio: float | None      # offloaded share of the optimizer states; None: not offloaded
    shared: bool
    recompute: bool
    states: bool = False     # the 'auto' moments in bf16 (lossy)
    masters: bool = False    # bf16 master weights (lossy)
    shard: int = 0           # MiCS over this many ranks (a node); 0: not MiCS
    secondary: int = 0       # hpZ over this many ranks (a node); 0: not hpZ
    qw: bool = False         # qwZ: stage 3's gathers as int8 codes (lossy)
    qg: bool = False         # qgZ: the gradients' reductions as int8 codes (lossy)
    tensor: int = 1          # AutoTP over this many ranks ('auto' in tensor_parallel.autotp_size); 1: none
    expert: int = 1          # AutoEP over this many ranks ('auto' in expert_parallel.autoep_size); 1: none
    qg_bits: int = 8         # qgZ's code width (zeroplus.quantized_gradient_bits: the config's, not chosen)
    qw_dtype: str = "int8"   # qwZ's codes (zeroplus.quantized_weights_dtype: the config's, not chosen)

    def describe(self) -> str:
        parts = [f"ZeRO stage {self.stage}"]
        if self.expert > 1:
            parts.insert(0, f"expert parallel over {self.expert} ranks (AutoEP)")
        if self.tensor > 1:
            parts.insert(0, f"tensor parallel over {self.tensor} ranks (AutoTP)")
        if self.shard:
            parts.append(f"MiCS over {self.shard} ranks")
        if self.secondary:
            parts.append(f"hpZ over {self.secondary} ranks")
        if self.ratio is not None:
            parts.append(f"optimizer states offloaded at ratio {self.ratio:g}")
        if self.shared:
            parts.append("shared master weights")
        if self.recompute:
            parts.append("resize recompute")
        if self.states:
            parts.append(LOSSY["states"])
        if self.masters:
            parts.append(LOSSY["masters"])
        parts += ([QUANTIZED["qw" if self.qw_dtype == "int8" else f"qw_{self.qw_dtype}"]] if self.qw else []) + \
            ([QUANTIZED["qg" if self.qg_bits == 8 else "qg4"]] if self.qg else [])
        return " + ".join(parts)

    @property
    def techniques(self) -> int:
        return (self.ratio is not None) + self.shared + self.recompute + self.lossy + self.qw + self.qg + \
            (self.tensor > 1) + (self.expert > 1)

    @property
    def split(self) -> int:
        """How many ranks split the model (tensor x expert): 1 for ZeRO alone."""
        return self.tensor * self.expert

    @property
    def lossy(self) -> int:
        return self.states + self.masters


@dataclasses.dataclass
class Plan:
    settings: Settings
    budget: MemoryBudget
    budget_bytes: int
    reason: str
    tried: list[tuple[Settings, int]]  # (candidate, predicted peak) in the order simulated
    links: dict[str, int] = dataclasses.field(default_factory=dict)  # the choice's bytes a step within / across nodes

    def apply(self, cfg: ZeroplusConfig) -> ZeroplusConfig:
        return apply_settings(cfg, self.settings)


def _candidates(cfg: ZeroplusConfig, world_size: int = 1,
                layouts: tuple[tuple[int, int], ...] = ((1, 1),)) -> list[Settings]:
    """Every combination of the 'auto' keys' values that can run together; ``layouts``: the (tensor, expert) sizes
    to try (``_layouts``). The layouts over nodes and the quantized collectives are tried where a layout's data ranks
    span several whole nodes (``_node``: beside tensor parallelism, in data ranks; not beside expert parallelism)."""
    zero, zp = cfg.zero_optimization, cfg.zeroplus
    stages = [0, 1, 2, 3] if zero.stage == "auto" else [int(zero.stage)]
    if zero.stage == "auto" and zp.parallel.pipeline > 1:  # stage 3 beside pipelines is refused (topology.py)
        stages = [0, 1, 2]
    block = zero.offload_optimizer
    if block is None or not zero.offloads_optimizer:
        ratios: list[float | None] = [None]
    elif block.ratio == "auto":
        ratios = [None, *RATIOS]
    else:
        ratios = [float(block.ratio)]
    bf16 = cfg.bf16.enabled is True
    shared = ([False, True] if bf16 else [False]) if zp.shared_master_weights == "auto" else [
        bool(zp.shared_master_weights)]
    recompute = [bool(zp.resize_recompute.enabled)]
    if zp.resize_recompute.enabled in ("auto", None):  # (unset: see note: recompute by default)
        recompute = [False] if zp.parallel.pipeline > 1 else [False, True]  # (pipeline stages refuse it)
    states = [False, True] if "auto" in (zp.optimizer_states.exp_avg, zp.optimizer_states.exp_avg_sq) and \
        _adam(cfg) else [False]
    masters = [False, True] if zp.master_weights.dtype == "auto" and bf16 and not zero.offloads_params else [False]
    out = []
    for tensor, expert in layouts:
        data = world_size // tensor
        node = _node(cfg, data, tensor) if expert == 1 else 0
        # MiCS over a node, or over several whole nodes where a node's share of the states does not fit (in data ranks)
        shards = [0] + ([k * node for k in range(1, data // node) if data % (k * node) == 0]
                        if zero.mics_shard_size == "auto" and node else [])
        secondaries = [0, node] if zero.zero_hpz_partition_size == "auto" and node else [0]
        # quantized collectives left 'auto': tried over several nodes, where they cut the bytes across them
        qws = [False, True] if zero.zero_quantized_weights == "auto" and node else [zero.zero_quantized_weights is True]
        qgs = [False, True] if zero.zero_quantized_gradients == "auto" and node else \
            [zero.zero_quantized_gradients is True]
        combinations = itertools.product(stages, ratios, shared, recompute, states, masters, shards, secondaries, qws,
                                         qgs)
        out += [Settings(*combination, tensor, expert, zp.quantized_gradient_bits, zp.quantized_weights_dtype)
                for combination in combinations
                if _runs(combination, zero)]
    return out


def _runs(combination: tuple[Any, ...], zero: Any) -> bool:
    """Whether a candidate's settings (``Settings``' order, without the layout) can run together."""
    stage, ratio, shared, _, _, masters, shard, secondary, qw, qg = combination
    if ratio is not None and stage == 0:
        return False  # offload needs a partitioned optimizer
    if masters and shared:
        return False  # bf16 and shared masters exclude each other
    if (shard and (stage == 0 or secondary)) or (secondary and stage != 3):
        return False  # MiCS shards at stages 1-3, hpZ serves stage 3's gathers, not both (topology.py)
    # qwZ quantizes stage 3's gathers, qgZ a reduce-scatter (engine/build.py's _check_quantized)
    return not ((qw and stage != 3) or (qg and (stage == 0 or not (zero.reduce_scatter or stage == 3))))


def _layouts(model: torch.nn.Module, cfg: ZeroplusConfig, world_size: int) -> tuple[tuple[int, int], ...]:
    """The (tensor, expert) sizes to plan over: (1, 1) unless ``tensor_parallel.autotp_size`` or
    ``expert_parallel.autoep_size`` is 'auto', then also every size of that key that divides the ranks, fits the
    topology and that the model's own plan splits (``autotp.check_plan``: heads, widths, vocabulary;
    ``autoep.check_experts``: expert counts; both above 1 on a mixture of experts: its experts split by expert, the
    rest by tensor, ``parallel/plans.py``). A model without the plan an 'auto' key needs is a ConfigError naming the
    key."""
    par = cfg.zeroplus.parallel
    keys = {"tensor": ("tensor_parallel.autotp_size", cfg.tensor_parallel.autotp_size, par.tensor, check_plan),
            "expert": ("expert_parallel.autoep_size", cfg.expert_parallel.autoep_size, par.expert, check_experts)}
    sizes: dict[str, list[int]] = {}
    for kind, (key, value, given, check) in keys.items():
        if value != "auto":
            sizes[kind] = [given]
            continue
        where = f"config key '{key}' is 'auto'"
        try:
            check(model, 1, where)
        except ValueError as err:
            raise ConfigError(f"{err}: the planner chooses {kind} sizes for a model split by its plan only") from None
        sizes[kind] = [size for size in range(1, world_size + 1) if world_size % size == 0 and _splits(check, model,
                                                                                                    size, where)]
    if par.pipeline > 1 and "auto" in (cfg.tensor_parallel.autotp_size, cfg.expert_parallel.autoep_size):
        raise ConfigError(f"config keys {auto_keys(cfg)} are 'auto' beside pipeline size {par.pipeline}: the planner "
                          f"chooses tensor and expert sizes beside data parallelism only so far; give sizes")
    out = []
    for tensor, expert in itertools.product(sizes["tensor"], sizes["expert"]):
        if tensor > 1 and expert > 1 and par.experts_span_tensor and experts_modules(model):
            continue  # (refused: parallel/plans.py)
        try:
            Topology(world_size, tensor, par.pipeline, expert, par.context, experts_span_tensor=par.experts_span_tensor)
        except ValueError:
            continue
        out.append((tensor, expert))
    return tuple(out)


def _splits(check: Callable[[torch.nn.Module, int, str], None], model: torch.nn.Module, size: int, where: str) -> bool:
    try:
        check(model, size, where)
    except ValueError:
        return False
    return True


def _node(cfg: ZeroplusConfig, data: int, tensor: int = 1) -> int:
    """A node's data ranks where the ``data`` ranks of a layout at tensor size ``tensor`` span several whole nodes
    (what MiCS, hpZ and the two-level collectives are laid over: ``parallel.groups.tiling_nodes``), else 0."""
    return tiling_nodes(cfg, data, tensor)


def _widths(cfg: ZeroplusConfig) -> tuple[int, int]:
    """The compute dtype's bytes an element and the micro-batches a step."""
    c = 2 if (cfg.bf16.enabled is True or cfg.fp16.enabled is True) else 4
    return c, int(cfg.gradient_accumulation_steps or 1)


def _adam(cfg: ZeroplusConfig) -> bool:
    """The config's optimizer is one stored states serve (Adam, AdamW)."""
    if cfg.optimizer is None:
        return False
    try:
        stored_states_class(resolve_optimizer_class(cfg.optimizer.type, dict(cfg.optimizer.params)))
    except ValueError:
        return False
    return True


def apply_settings(cfg: ZeroplusConfig, s: Settings) -> ZeroplusConfig:
    out = copy.deepcopy(cfg)
    out.zero_optimization.stage = s.stage
    block = out.zero_optimization.offload_optimizer
    if block is not None:
        if s.ratio is None:
            block.device = "none"
            block.ratio = 1.0
        else:
            block.ratio = s.ratio
    out.zeroplus.shared_master_weights = s.shared
    out.zeroplus.resize_recompute.enabled = s.recompute
    moments = out.zeroplus.optimizer_states
    for key in ("exp_avg", "exp_avg_sq"):
        if getattr(moments, key) == "auto":
            setattr(moments, key, "bf16" if s.states else "fp32")
    if out.zeroplus.master_weights.dtype == "auto":
        out.zeroplus.master_weights.dtype = "bf16" if s.masters else "fp32"
    zero = out.zero_optimization
    if zero.mics_shard_size == "auto":
        zero.mics_shard_size = s.shard or -1
    if zero.zero_hpz_partition_size == "auto":
        zero.zero_hpz_partition_size = s.secondary or 1
    if zero.zero_quantized_weights == "auto":
        zero.zero_quantized_weights = s.qw
    if zero.zero_quantized_gradients == "auto":
        zero.zero_quantized_gradients = s.qg
    if out.tensor_parallel.autotp_size == "auto":
        out.tensor_parallel.autotp_size = out.zeroplus.parallel.tensor = s.tensor
    if out.expert_parallel.autoep_size == "auto":
        out.expert_parallel.autoep_size = out.zeroplus.parallel.expert = s.expert
    return out


def links(cfg: ZeroplusConfig, s: Settings, params: int, world_size: int,
          exchanged: tuple[int, int, int, int] = (0, 0, 0, 0)) -> dict[str, int]:
    """Bytes a rank sends a step within a node (``intra_node``) and across nodes (``inter_node``), as rings move them
    (a collective's message times (n - 1) / n over its n ranks): stages 0-1 all-reduce or reduce-scatter and gather the
    model once a step (2 c P), stage 2 reduces every micro-batch ((A + 1) c P), stage 3 gathers twice and reduces once
    every micro-batch (3 A c P). On one node everything is within it; across several, a flat layout's groups span them.
    MiCS over a node keeps its collectives within the node and all-reduces the gradient shard (fp32 when accumulating)
    across the replicas once a step, and a shard group over several nodes gathers across them in two levels where
    ``mics_hierarchical_params_gather`` asks; hpZ gathers across only each step's first forward, the other 2A - 1 passes
    within the node (its copy in the compute dtype). qwZ sends stage 3's gathers from the shards as
    ``WEIGHT_CODE_BYTES`` an element (int8 by default); qgZ the reductions (0.516 bytes an element at ``s.qg_bits`` 4),
    over several nodes in two levels: all within the node, then 1/L of the elements across (see note: planner links).
    With tensor parallelism (``s.tensor`` T), ZeRO's collectives run over the world / T data ranks on a T-th of the
    parameters (laid over nodes as above where a node holds whole data ranks of each tensor rank, else across nodes
    where the ranks span several), and the tensor group all-reduces and all-gathers ``exchanged`` elements a step (ring:
    2 (T - 1) / T and (T - 1) / T of them), within a node unless T is wider than one; with expert parallelism
    (``s.expert`` E) the expert group sends (E - 1) / E of ``exchanged[2]`` elements by all-to-all, within a node unless
    E is wider than one (and the tensor group then leaves out ``exchanged[3]``, the experts' part of ``exchanged[0]``:
    the expert group splits them)."""
    if s.split == 1:
        return _zero_links(cfg, s, params, world_size, _node(cfg, world_size))
    c = _widths(cfg)[0]
    T, E, node_size = s.tensor, s.expert, ranks_per_node(cfg)
    across = 1 < node_size < world_size
    node = _node(cfg, world_size // T, T) if E == 1 else 0
    data = _zero_links(cfg, dataclasses.replace(s, tensor=1, expert=1), params // T, world_size // T, node)
    out = {"intra_node": 0.0, "inter_node": 0.0}
    if node:  # (the data ranks tile nodes: ZeRO's collectives as laid over them)
        out = {link: float(value) for link, value in data.items()}
    else:
        out["inter_node" if across else "intra_node"] += sum(data.values())
    summed = exchanged[0] - (exchanged[3] if E > 1 else 0)
    out["inter_node" if across and T > node_size else "intra_node"] += c * (T - 1) / T * (2 * summed + exchanged[1])
    out["inter_node" if across and E > node_size else "intra_node"] += c * (E - 1) / E * exchanged[2]
    return {link: int(value) for link, value in out.items()}


def _zero_links(cfg: ZeroplusConfig, s: Settings, params: int, world_size: int, node: int) -> dict[str, int]:
    """``links`` of ZeRO's collectives over ``world_size`` data ranks holding ``params`` elements, in nodes of
    ``node`` of them (0: one node, or not tiling nodes)."""
    c, ga = _widths(cfg)

    def ring(n: int) -> float:
        return (n - 1) / n

    gathered = c * params  # one gather's bytes: the first forward's of each step, as codes under qwZ
    first = WEIGHT_CODE_BYTES[s.qw_dtype] * params if s.qw else gathered
    passes = {0: 0, 1: 1, 2: 1, 3: 2 * ga}[s.stage]  # gathers a step; the reductions' count and message:
    reductions = {0: 1, 1: 1, 2: ga, 3: ga}[s.stage]
    reduced: float = (2 * c if s.stage == 0 else c) * params
    gathers = first + (passes - 1) * (first if s.stage == 3 else gathered) if passes else 0.0
    if s.qg:
        reduced = _coded(s.qg_bits) * params
    out = {"intra_node": 0.0, "inter_node": 0.0}
    group = s.shard or world_size  # the ranks ZeRO shards over
    if s.shard:  # the replicas all-reduce the gradient shard across nodes once a step (fp32 when accumulating)
        replicas, grad = world_size // s.shard, 4 if ga > 1 else c
        out["inter_node"] += 2 * ring(replicas) * grad * params / s.shard
        if s.shard <= node or not node:  # within a node
            out["intra_node"] += ring(s.shard) * (gathers + reductions * reduced)
            return {link: int(value) for link, value in out.items()}
    far = "inter_node" if node else "intra_node"
    if s.secondary:  # (hpZ's copy is in the compute dtype)
        out["inter_node"] += ring(world_size) * first
        out["intra_node"] += ring(s.secondary) * (2 * ga - 1) * gathered
    elif s.shard and cfg.zero_optimization.mics_hierarchical_params_gather:  # over several nodes, in two levels
        out["inter_node"] += ring(group // node) * gathers / node
        out["intra_node"] += ring(node) * gathers
    else:
        out[far] += ring(group) * gathers
    if s.qg and node:  # two levels: every element within the node, 1/L of them across
        out["intra_node"] += ring(node) * reductions * reduced
        out["inter_node"] += ring(group // node) * reductions * reduced / node
    else:
        out[far] += ring(group) * reductions * reduced
    return {link: int(value) for link, value in out.items()}


def cost(cfg: ZeroplusConfig, s: Settings, params: int, world_size: int,
         exchanged: tuple[int, int, int, int] = (0, 0, 0, 0)) -> float:
    """Seconds per optimizer step spent moving bytes, on the nominal machine of ``BANDWIDTH``: at its ``comm``
    bandwidth, where the ranks span several nodes across them and ``zeroplus.link_ratio`` times faster within one
    (``links``)."""
    moved = links(cfg, s, params, world_size, exchanged)
    within = moved["intra_node"] / (cfg.zeroplus.link_ratio if 1 < ranks_per_node(cfg) < world_size else 1.0)
    seconds = (moved["inter_node"] + within) / BANDWIDTH["comm"]
    params, world_size = params // s.tensor, world_size // s.tensor  # (a rank's slice, over the data ranks)
    owned = params / (world_size if ZeroStage(s.stage).partitions else 1)
    block = cfg.zero_optimization.offload_optimizer
    if s.ratio is not None and block is not None:
        seconds += 2 * s.ratio * owned * 8 / BANDWIDTH[block.device]  # AdamW's two states, read and written
    if s.shared:
        seconds += 8 * owned / BANDWIDTH["memory"]
    if s.states:  # the moments copied into fp32 and back
        seconds += 2 * 12 * owned / BANDWIDTH["memory"]
    if s.masters:  # the master widened and stored back
        seconds += 6 * owned / BANDWIDTH["memory"]
    c, ga = _widths(cfg)
    n = world_size if ZeroStage(s.stage).partitions else 1
    if s.qw:  # each gather: the shard quantized (c in, a code out), every part dequantized (a code in, c out)
        seconds += 2 * ga * (1 + c) * params * (1 + 1 / n) / BANDWIDTH["memory"]
    if s.qg:  # each reduction: the bucket quantized (c in, a code out), every row dequantized and summed in fp32
        seconds += (1 if s.stage == 1 else ga) * (c + 6) * params / BANDWIDTH["memory"]
    return seconds


def plan(model: torch.nn.Module | Callable[[], torch.nn.Module], config: dict[str, Any] | str | ZeroplusConfig, *,
         world_size: int, budget: str | int | None = None, rank: int = 0, micro_batch_size: int | None = None,
         seq_len: int | None = None, example_inputs: tuple[Any, ...] | None = None,
         log: Callable[[str], None] | None = None, code: int | None = None) -> Plan:
    """The cheapest candidate whose predicted peak fits ``budget`` (default: the config's
    ``zeroplus.memory_budget``); ``ConfigError`` naming the smallest budget that fits if none does.
    ``code``: as ``estimate`` takes it (``initialize`` plans for its own process)."""
    cfg = load_config(config)
    raw = budget if budget is not None else cfg.zeroplus.memory_budget
    if raw is None:
        raise ConfigError("planning needs a memory budget: config key 'zeroplus.memory_budget' (e.g. '16GB')")
    limit = parse_bytes(raw)
    if seq_len is None and example_inputs is None:
        seq_len = cfg.zeroplus.seq_len
        if seq_len is None:
            raise ConfigError("planning to config key 'zeroplus.memory_budget' needs the input's length: set "
                              "'zeroplus.seq_len' (activations are predicted for micro-batches of that many tokens)")
    module = _meta_module(model)
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    layouts = _layouts(module, cfg, world_size)
    exchanged = _exchanged(module, cfg, layouts, micro_batch_size, seq_len, example_inputs)
    ordered = sorted(_candidates(cfg, world_size, layouts),
                     key=lambda s: (s.lossy, s.split, s.tensor, cost(cfg, s, params, world_size, exchanged),
                                    s.techniques))
    if not ordered:
        raise ConfigError("config key 'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (stage is 0), "
                          "so no choice is left to plan")

    def predict(s: Settings) -> MemoryBudget:
        return estimate(model, apply_settings(cfg, s), world_size=world_size, rank=rank,
                        micro_batch_size=micro_batch_size, seq_len=seq_len, example_inputs=example_inputs,
                        code=code)

    # (MiCS keeps model states over a node's ranks only, hpZ a copy of the blocks: the frugal choice is neither.) With
    # several (tensor, expert) sizes, each one's frugal choice: a wider split need not hold less (a vocabulary's
    # logits gathered whole, a small model's replicated norms), so the least of them is the smallest peak
    frugals = [max((s for s in ordered if (s.tensor, s.expert) == layout), key=lambda s: (
        s.stage, not s.shard, not s.secondary, s.ratio or 0.0, s.recompute, s.masters, s.shared, s.states))
        for layout in dict.fromkeys((s.tensor, s.expert) for s in ordered)]
    predicted_frugal = {s: predict(s) for s in frugals}
    frugal, least = min(predicted_frugal.items(), key=lambda item: item[1].peak_bytes)
    if log is not None:
        log(f"planner: the most frugal choice, {frugal.describe()}: predicted peak {_gib(least.peak_bytes)}")
    if least.peak_bytes > limit:
        raise ConfigError(f"config key 'zeroplus.memory_budget' is {raw!r} ({_gib(limit)}), and no choice fits it on "
                          f"{world_size} ranks: the smallest predicted peak is {_gib(least.peak_bytes)} (in "
                          f"{least.peak_phase}) with "
                          f"{frugal.describe()}; a budget of at least {_gib(least.peak_bytes)} would fit with that "
                          f"config")
    tried: list[tuple[Settings, int]] = []
    for s in ordered:
        predicted = predicted_frugal[s] if s in predicted_frugal else predict(s)
        tried.append((s, predicted.peak_bytes))
        if log is not None:
            log(f"planner: {s.describe()}: predicted peak {_gib(predicted.peak_bytes)} in {predicted.peak_phase}")
        if predicted.peak_bytes <= limit:
            misses = "; ".join(f"{t.describe()} needs {_gib(p)}" for t, p in tried[:-1])
            moved = links(cfg, s, params, world_size, exchanged)
            reason = (f"{s.describe()} fits the budget of {_gib(limit)} with a predicted peak of "
                      f"{_gib(predicted.peak_bytes)} in {predicted.peak_phase}; of {len(ordered)} choices it is the "
                      f"one that fits and moves the fewest bytes per step (a rank's: {_gib(moved['inter_node'])} "
                      f"across nodes, {_gib(moved['intra_node'])} within one)"
                      + (", and no exact choice fits" if s.lossy else "")
                      + (", and none with fewer ranks splitting the model fits" if s.split > 1 else "")
                      + (f" (cheaper ones do not fit: {misses})" if misses else ""))
            return Plan(s, predicted, limit, reason, tried, moved)
    raise AssertionError("the most frugal choice fitted, so some choice must")


def _meta_module(model: torch.nn.Module | Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model, or the one ``model()`` builds on the meta device (its shapes only are read)."""
    if isinstance(model, torch.nn.Module):
        return model
    with torch.device("meta"):
        return model()


def _exchanged(module: torch.nn.Module, cfg: ZeroplusConfig, layouts: tuple[tuple[int, int], ...], micro: int | None,
               seq_len: int | None, example_inputs: tuple[Any, ...] | None) -> tuple[int, int, int, int]:
    """The elements a step's micro-batches exchange: the tensor group's all-reduced and all-gathered
    (``autotp.exchanged_per_token``), the expert group's all-to-all (``autoep.exchanged_per_token``), and the part of
    the first the experts' own split adds (left out where the expert group splits them), times the tokens, where
    those sizes are planned; else none."""
    if layouts == ((1, 1),):
        return (0, 0, 0, 0)
    if seq_len is not None:
        given = micro or cfg.train_micro_batch_size_per_gpu
        tokens = (given if isinstance(given, int) else 1) * seq_len
    else:
        first = (example_inputs or ())[0] if example_inputs else None
        tokens = first.numel() if isinstance(first, torch.Tensor) else 1
    tokens *= _widths(cfg)[1]
    reduced, gathered = tensor_exchanged(module)
    beside = tensor_exchanged(module, tuple(name for name, _ in experts_modules(module)))[0]
    return reduced * tokens, gathered * tokens, experts_exchanged(module) * tokens, (reduced - beside) * tokens


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
