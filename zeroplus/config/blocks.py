"""Validated config blocks, one pydantic model per DeepSpeed block, plus zeroplus's own block.

Every model forbids unknown keys; ``ds_unimplemented`` lists DeepSpeed keys that are accepted
with one warning (see ``keys.check_keys``). ``"auto"`` is accepted where Hugging Face templates
use it and resolved later by ``resolve.py``; it is never read as true.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

Auto = Literal["auto"]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0.0)]


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)
    ds_unimplemented: ClassVar[frozenset[str]] = frozenset()
    _frozen: bool = PrivateAttr(default=False)  # set by ``freeze``: a resolved config is read, never written

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("_") and (getattr(self, "__pydantic_private__", None) or {}).get("_frozen"):
            raise AttributeError(f"config block {type(self).__name__}: key {name!r} of a resolved config is frozen "
                                 f"(the engine's choices live in its own objects; a config to change is a copy: "
                                 f"zeroplus.config.load_config)")
        super().__setattr__(name, value)


def freeze(block: BaseModel, frozen: bool = True) -> BaseModel:
    """``block`` and every block inside it (fields, lists and dicts of blocks) frozen (or thawed); returns it."""
    if isinstance(block, Block):
        object.__setattr__(block, "__pydantic_private__", {**(block.__pydantic_private__ or {}), "_frozen": frozen})
    for name in type(block).model_fields:
        value = getattr(block, name)
        for item in (value.values() if isinstance(value, dict) else value if isinstance(value, list) else (value,)):
            if isinstance(item, BaseModel):
                freeze(item, frozen)
    return block


class OptimizerConfig(Block):
    type: str = Field(description="Adam, AdamW, SGD, Lamb (any case) or any torch.optim class name.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the optimizer.")


class SchedulerConfig(Block):
    type: str = Field(description="WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle.")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the schedule.")


class MasterWeightsConfig(Block):
    """The dtype the optimizer's master weights are kept in (``zeroplus/zero/master_store.py``: ``Bf16Master``)."""

    dtype: Literal["fp32", "bf16"] | Auto | None = Field(
        None, description="fp32 (exact), or bf16: the master is the bf16 weight itself, stepped in fp32 and rounded "
                          "back (2 or 4 bytes per owned parameter less; lossy). Unset: bf16 where "
                          "bf16.bf16_master_weights_and_grads is true, else fp32; 'auto': the planner chooses bf16 "
                          "only where the memory budget needs it, and says so. An exact master in bf16's bytes "
                          "plus 2: zeroplus.shared_master_weights.")
    rounding: Literal["nearest", "stochastic"] = Field(
        "stochastic", description="How a bf16 master stepped in fp32 is stored: stochastically, by a hash of the value "
                                  "and the step, the same on any layout; or to nearest (ties to even), which loses "
                                  "every update below half a bf16 step (the main job: loss +1.6% after 300 steps, "
                                  "stochastic -0.01%).")


class OptimizerStatesConfig(Block):
    """The dtypes Adam's and AdamW's moments are stored in (``zeroplus/optim/stored_states.py``)."""

    exp_avg: Literal["fp32", "bf16", "fp16", "fp8", "mxfp8"] | Auto | None = Field(
        None, description="The first moment's dtype (unset: bf16 where bf16.bf16_optimizer_states is true, else fp32; "
                          "'auto', with exp_avg_sq 'auto': the planner stores both in bf16 only where the memory "
                          "budget needs it, and says so).")
    exp_avg_sq: Literal["fp32", "bf16", "fp16", "fp8", "mxfp8"] | Auto | None = Field(
        None, description="The second moment's dtype (unset: as exp_avg's rule; 'auto': as exp_avg's; fp8 and mxfp8: "
                          "its square root is stored).")
    block: Literal[128, 256] | None = Field(
        None, description="fp8 moments (e4m3): elements per power-of-two fp32 scale (unset: 128; "
                          "zeroplus/kernels/block_fp8.py). mxfp8 moments: e4m3 with an e8m0 scale per 32 elements, "
                          "the MX format's (a block set with mxfp8 is refused).")
    rounding: Literal["nearest", "stochastic"] | None = Field(
        None, description="How a moment computed in fp32 is stored: to nearest, or (bf16, fp8, mxfp8) "
                          "stochastically, by a hash of the value and the step, the same on any layout (unset: "
                          "stochastic where a moment is fp8 or mxfp8, whose 3 mantissa bits lose an average's small "
                          "updates to nearest, else nearest).")


class OffloadOptimizerConfig(Block):
    """Optimizer states on a tier, streamed in sub-groups (``offload/optimizer_states.py``)."""

    ds_unimplemented = frozenset({"fast_init", "pipeline", "pipeline_read", "pipeline_write"})
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = Field(4, ge=1)
    ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Auto = Field(
        1.0, description="Share of the optimizer states offloaded; 'auto': the planner chooses "
                         "(zeroplus.memory_budget).")


class OffloadParamConfig(Block):
    """Stage 3: the master (parameter) shards on a tier (``zeroplus/zero/tiered_master.py``)."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = Field(5, ge=1)
    buffer_size: int = Field(100_000_000, ge=1)
    max_in_cpu: int = Field(1_000_000_000, ge=0)


class ZeroConfig(Block):
    ds_unimplemented = frozenset({
        "round_robin_gradients", "elastic_checkpoint", "load_from_fp32_weights",
        "ignore_unused_parameters",
        "memory_efficient_linear", "stage3_module_granularity_threshold",
        "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", "legacy_stage1",
        "use_multi_rank_bucket_allreduce", "pipeline_loading_checkpoint", "override_module_apply",
        "log_trace_cache_warnings", "use_all_reduce_for_fetch_params", "save_muon_momentum_buffer_in_memory",
    })
    stage: Annotated[int, Field(ge=0, le=3)] | Auto = Field(
        0, description="ZeRO stage: 0 none, 1 optimizer states, 2 +grads, 3 +params; 'auto': the planner chooses "
                       "(zeroplus.memory_budget).")
    overlap_comm: bool | None = Field(None, description="Overlap gradient reduction with backward (default: on).")
    contiguous_gradients: bool = True
    reduce_bucket_size: PositiveInt | Auto = Field(500_000_000, description="Elements per gradient bucket.")
    allgather_partitions: bool = Field(
        True, description="How the updated partitions reach every rank after the step (stages 1-2): DeepSpeed's "
                          "false broadcasts each rank's instead of one all-gather, with the same weights; "
                          "zeroplus all-gathers either way.")
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="Elements per all-gather bucket (stages 1-2).")
    reduce_scatter: bool = Field(True, description="Reduce-scatter gradients (False: all-reduce, keep own shard).")
    stage3_prefetch_bucket_size: NonNegativeInt | Auto | None = Field(
        None, description="Elements of the next units gathered ahead of use (stage 3). Unset: one unit "
                          "ahead (DeepSpeed's default of 5e7 elements would hold ~100 MB of bf16 parameters in "
                          "flight for no gain when one unit's compute hides the next unit's gather).")
    stage3_param_persistence_threshold: NonNegativeInt | Auto = Field(
        100_000, description="Units with at most this many elements stay gathered (stage 3).")
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, json_schema_extra={"aliases": ["gather_16bit_weights_on_model_save",
                                              "stage3_gather_fp16_weights_on_model_save"]})
    sub_group_size: int = Field(1_000_000_000, ge=1, description="Elements per optimizer sub-group.")
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    mics_shard_size: int | Auto = Field(
        -1, description="MiCS / HSDP: ZeRO shards over groups of this many consecutive data ranks and replicates "
                        "across the groups, the gradients reduce-scattered within a group and all-reduced across "
                        "(stages 1-3, beside data parallelism only; -1 or the data-parallel size: every data rank); "
                        "'auto': the planner chooses the node's ranks or -1 (zeroplus.memory_budget).")
    mics_hierarchical_params_gather: bool = Field(
        False, description="MiCS: the parameters' gathers over a shard group that spans nodes run in two levels, "
                           "across the nodes among the ranks at one place in each, then within each node, so each "
                           "rank receives 1/(ranks per node) of the bytes across nodes it would in one level "
                           "(zeroplus.node_size or the launch's LOCAL_WORLD_SIZE). Within one node there is nothing "
                           "to change; without mics_shard_size it does nothing, as in DeepSpeed.")
    zero_hpz_partition_size: int | Auto = Field(
        1, description="hpZ (ZeRO++): at stage 3 each gathered unit's values are also kept split over groups of this "
                       "many consecutive data ranks (a node), so its later gathers until the next step (backward, "
                       "recompute, further micro-batches) stay within the group; 1 or the data-parallel size: off. "
                       "Costs the unit's values / this size per rank in the compute dtype from forward to the step; "
                       "'auto': the planner chooses the node's ranks or 1 (zeroplus.memory_budget).")
    zero_quantized_weights: bool | Auto = Field(
        False, description="qwZ (ZeRO++; 'auto': the planner chooses over several nodes, zeroplus.memory_budget): "
                           "stage 3's training gathers send int8 codes with a scale per 256 elements "
                           "(1.016 bytes an element on the wire); every rank computes with the same dequantized "
                           "weights, each within max|block| / 254 of the exact value; shards, masters and states stay "
                           "exact, and gathers for reading the model (state_dict, GatheredParameters) are exact.")
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++: stage 3's frozen shards (parameters no optimizer trains, a LoRA model's base) kept "
                           "as int8 codes with an fp32 scale per 256 elements, about 1 byte an element instead of 2 "
                           "or 4, gathered as codes; each value within max|block| / 254 of the model's.")
    zero_quantized_gradients: bool | Auto = Field(
        False, description="qgZ (ZeRO++; 'auto': the planner chooses over several nodes, zeroplus.memory_budget): "
                           "the gradients' reduce-scatter (stages 1-3) sends int8 codes with a scale "
                           "per 256 elements in two all-to-alls; each rank sums the dequantized parts in fp32, each "
                           "element within the sum over ranks of max|block| / 254 of the exact sum (times 1/D).")

    @field_validator("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                     "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "sub_group_size", mode="before")
    @classmethod
    def _whole_elements(cls, value: Any) -> Any:
        """A count of elements given as a fractional number (TRL writes ``0.9 * hidden * hidden``): the
        whole elements below it."""
        if isinstance(value, float) and value >= 0:
            return int(value)
        return value

    @property
    def offloads_optimizer(self) -> bool:
        """Optimizer states go to a lower tier (``offload_optimizer.device`` is ``cpu`` or ``nvme``)."""
        return self.offload_optimizer is not None and self.offload_optimizer.device != "none"

    @property
    def offloads_params(self) -> bool:
        """Parameter shards go to a lower tier (``offload_param.device`` is ``cpu`` or ``nvme``)."""
        return self.offload_param is not None and self.offload_param.device != "none"


class ActivationCheckpointingConfig(Block):
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class ResizeRecomputeConfig(Block):
    enabled: bool | Auto | None = Field(
        None, description="Unset: on wherever it can run (not with compiled modules or pipeline stages: see note: "
                          "recompute by default), and with a memory_budget the planner's choice; 'auto': the "
                          "planner's choice within memory_budget.")
    modules: list[str] | None = Field(None, description="Module class names whose outputs are dropped after "
                                                        "forward and recomputed (default: every activation "
                                                        "function whose backward keeps its input, found by what it "
                                                        "computes).")
    norms: bool = Field(True, description="Also every normalisation layer: torch's LayerNorm, RMSNorm and "
                        "GroupNorm, their subclasses, and any module whose forward normalises over the last "
                        "dimension (found by what it computes, whatever its class is called).")
    names: list[str] = Field(default_factory=list, description="Qualified-name patterns (fnmatch), e.g. "
                                                               "'blocks.*.mlp.act'.")
    functional: bool = Field(True, description="Also the functional forms the model's forward calls itself: "
                             "F.gelu, F.silu, F.mish, and with norms F.layer_norm, F.rms_norm, F.group_norm.")


class SwapAttentionConfig(Block):
    enabled: bool = False
    modules: list[str] | None = Field(None, description="Module class names whose saved activations are swapped "
                                                        "(default: the modules that attend, found by what "
                                                        "they compute on one meta-device forward).")
    names: list[str] = Field(default_factory=list, description="Qualified-name patterns (fnmatch).")
    min_bytes: NonNegativeInt = Field(65536, description="Smaller saved tensors stay on the device.")


_REFUSED_CHECKPOINT_KEYS = {
    "load_universal": "universal checkpoints are not read; load a DeepSpeed ZeRO checkpoint directly with "
                      "load_checkpoint (it is imported, at any world size and stage) or convert it with 'zeroplus "
                      "convert --from-deepspeed', and remove the key",
    "use_node_local_storage": "zeroplus writes every rank's file into the save directory, which every rank must be "
                              "able to read (a shared filesystem: loading reshards at any world size); remove the "
                              "key and save to a shared path",
}


class CheckpointConfig(Block):
    """DeepSpeed's ``"checkpoint"`` block, as training checkpoints read it (``engine/checkpoints/save.py``)."""

    tag_validation: str = Field(
        "WARN", description="Whether every rank saved under the same tag: Warn (log it; the first rank's tag is "
                            "used), Ignore (use the first rank's), Fail (every rank raises before anything is "
                            "written). Any case.")
    load_universal: bool = Field(
        False, description="Not read: true is refused. DeepSpeed's ZeRO checkpoints load directly with "
                           "load_checkpoint (imported on the fly) at any world size and stage.")
    use_node_local_storage: bool = Field(
        False, description="Not read: true is refused. Every rank's file goes into the save directory, which "
                           "every rank reads when resharding (a shared filesystem).")
    parallel_write: dict[str, bool] = Field(
        default_factory=dict, description="DeepSpeed's pipeline_stage: every rank writes its own file at once "
                                          "already, so it changes nothing.")

    @field_validator("tag_validation")
    @classmethod
    def _mode(cls, value: str) -> str:
        if value.upper() not in ("WARN", "IGNORE", "FAIL"):
            raise ValueError(f"one of Warn, Ignore, Fail (any case), not {value!r}")
        return value.upper()

    @field_validator("load_universal", "use_node_local_storage")
    @classmethod
    def _refused(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            raise ValueError(_REFUSED_CHECKPOINT_KEYS[str(info.field_name)])
        return value

    @field_validator("parallel_write")
    @classmethod
    def _parallel_write(cls, value: dict[str, bool]) -> dict[str, bool]:
        unknown = sorted(set(value) - {"pipeline_stage"})
        if unknown:
            raise ValueError(f"only 'pipeline_stage' is a key of parallel_write, not {unknown}")
        return value


class TiledConfig(Block):
    """Tiled MLP and tiled loss (``zeroplus/activations/tiled.py``): unset leaves them untiled."""

    mlp_tokens: PositiveInt | None = Field(
        None, description="Tokens per tile of every position-wise MLP: its wide intermediate exists for one "
                          "tile at a time, in forward and backward. Tokens of the whole sequence: under "
                          "zeroplus.parallel.context C each rank's tile is ceil(mlp_tokens / C).")
    mlp_modules: list[str] | None = Field(
        None, description="MLP class names to tile (default: the outermost position-wise MLPs, found by "
                          "what they compute; mixtures of experts and their experts left out).")
    loss_tokens: PositiveInt | None = Field(
        None, description="Tokens per tile of the LM head and cross-entropy (zeroplus's GPT or a Hugging Face "
                          "causal LM): the vocabulary-sized logits exist for one tile at a time. Tokens of the "
                          "whole sequence: under zeroplus.parallel.context C each rank's tile is "
                          "ceil(loss_tokens / C).")


class ActivationTierConfig(Block):
    device: Literal["host", "file"] = Field(
        "host", description="Where swapped activations and cpu_checkpointing inputs go: host memory (pinned), or "
                            "files under 'path' (the tier that saves memory on a CPU-only machine).")
    path: str | None = Field(None, description="Directory for the file tier.")


class TensorParallelConfig(Block):
    """DeepSpeed's ``tensor_parallel`` block (AutoTP training): its size is zeroplus's tensor size."""

    ds_unimplemented = frozenset({"tp", "dtype", "keep_module_on_host", "tp_overlap_comm", "tp_grain_size",
                                  "injection_policy_tuple", "partition_config"})
    autotp_size: PositiveInt | Auto = Field(
        1, description="Tensor-parallel size (the same as zeroplus.parallel.tensor): a Hugging Face model is split by "
                       "its own tensor-parallel plan (zeroplus/parallel/autotp.py); other models are built with "
                       "zeroplus.parallel's layers. 'auto': the planner chooses it within zeroplus.memory_budget, "
                       "among the sizes that divide the ranks and that the model's plan splits.")


class ExpertParallelConfig(Block):
    """DeepSpeed's ``expert_parallel`` block (AutoEP training): ``enabled`` with ``autoep_size`` is zeroplus's expert
    size, and a Hugging Face mixture of experts is split by its own expert-parallel plan
    (``zeroplus/parallel/autoep.py``). The model's own router and expert math run unchanged, so the keys that
    replace DeepSpeed's router or its expert kernels are not accepted; those that choose only how DeepSpeed moves
    tokens are accepted with a warning."""

    ds_unimplemented = frozenset({"use_grouped_mm", "disable_triton_grouped_mm", "comm_backend", "comm_num_sm",
                                  "comm_qp_margin", "comm_max_tokens_per_rank", "async_split_plan",
                                  "validate_folding_routing"})
    enabled: bool = Field(False, description="Expert parallelism for a Hugging Face mixture of experts.")
    autoep_size: PositiveInt | Auto = Field(
        1, description="Expert-parallel size (the same as zeroplus.parallel.expert), read when enabled. 'auto': the "
                       "planner chooses it within zeroplus.memory_budget, among the sizes that divide the data ranks "
                       "and every experts module's expert count.")
    expert_tensor_parallel_size: Literal[1] = Field(1, description="Experts split over tensor ranks too: 1 only.")


class ParallelConfig(Block):
    """Model parallelism beside ZeRO (``zeroplus/parallel/topology.py``): world = data x context x tensor x pipeline."""

    tensor: PositiveInt = Field(1, description="Tensor-parallel size: ranks that split each layer's weights.")
    pipeline: PositiveInt = Field(1, description="Pipeline-parallel size: ranks that each run a slice of the layers.")
    expert: PositiveInt = Field(1, description="Expert-parallel size, carved out of the data-parallel ranks (it "
                                               "divides data size): ranks that split a mixture-of-experts layer.")
    expert_capacity_factor: PositiveFloat | None = Field(
        None, description="A Hugging Face mixture of experts split by its plan (AutoEP): at most "
                          "ceil(k x tokens / experts x factor) of each rank's (token, choice) pairs per expert, "
                          "earlier choices and earlier tokens first, the rest dropped (their weight's share of the "
                          "output is lost); unset: dropless.")
    experts_span_tensor: bool = Field(
        False, description="The expert-data mode: expert groups drawn from data x tensor ranks rather than data "
                           "ranks alone (expert a multiple of tensor, dividing data x tensor), so tensor parallelism "
                           "stays in attention and experts are never split; each tensor rank routes 1/tensor of "
                           "its tokens.")
    context: PositiveInt = Field(1, description="Context-parallel size: ranks that each hold 1/context of every "
                                                "sequence's tokens (ZeRO partitions over data x context).")
    context_mode: Literal["ulysses", "ring", "hybrid"] = Field(
        "ulysses", description="How attention sees the whole sequence: 'ulysses' (all-to-all from a sequence split to "
                               "a head split and back), 'ring' (K/V blocks passed around the context ranks) or "
                               "'hybrid' (Ulysses over groups of ulysses_size ranks, a ring across them).")
    ulysses_size: PositiveInt = Field(
        1, description="context_mode 'hybrid': the ranks of each Ulysses group (heads split over them); the ring "
                       "runs over context / ulysses_size of them. Both above 1.")
    sequence_parallel: bool = Field(False, description="Split activations along the sequence between "
                                                       "tensor-parallel regions (norms, dropout, residuals).")
    overlap_chunks: PositiveInt = Field(
        1, description="Chunks each tensor-parallel collective and its matmul are cut into, so that chunk i+1 "
                       "communicates while chunk i computes (1: communicate, then compute).")

    @model_validator(mode="after")
    def _hybrid_sizes(self) -> ParallelConfig:
        u, c = self.ulysses_size, self.context
        if self.context_mode != "hybrid":
            if u != 1:
                raise ValueError(f"zeroplus.parallel.ulysses_size is {u}: it splits the context ranks only under "
                                 f"context_mode 'hybrid' (context_mode is {self.context_mode!r})")
        elif not (1 < u < c and c % u == 0):
            raise ValueError(f"zeroplus.parallel.context_mode 'hybrid' runs Ulysses over ulysses_size ranks and a ring "
                             f"over context / ulysses_size: context {c} and ulysses_size {u} need 1 < ulysses_size "
                             f"< context with context divisible by it (use 'ulysses' or 'ring' for one of them)")
        return self


class ZeroplusBlock(Block):
    """zeroplus-only options; DeepSpeed ignores this block, so one file runs under both."""

    unit_modules: list[str] | None = Field(
        None, description="Module class names that each become one partition unit (default: repeated blocks).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    fused_optimizer: bool = Field(True, description="Use torch's fused optimizer kernel where it exists.")
    elementwise_optimizer: bool = Field(
        False, description="The optimizer (a client's, or a torch.optim class the config names) updates each "
                           "element from that element's gradient and states alone, so stepping flat shards cut "
                           "across parameters is exact. Needed only for a class zeroplus does not know to be so "
                           "(torch.optim's SGD, Adam, AdamW, Adagrad, Adamax, NAdam, RAdam, RMSprop, ASGD, Rprop, "
                           "Adadelta, subclasses that keep their step, and zeroplus's Lamb); any other is refused "
                           "at initialize.")
    shared_master_weights: bool | Auto = Field(
        False, description="bf16 only: keep the fp32 master as the bf16 weights plus 16-bit residuals "
                           "(2 bytes per owned parameter less), restored exactly before each step.")
    master_rounding: Literal["nearest_even", "like_shared"] = Field(
        "nearest_even", description="How a separate bf16 copy rounds the fp32 master: torch's cast, or ties away "
                                    "from zero as shared master weights do (to compare runs bit for bit).")
    optimizer_states: OptimizerStatesConfig = Field(default_factory=OptimizerStatesConfig)
    master_weights: MasterWeightsConfig = Field(default_factory=MasterWeightsConfig)
    resize_recompute: ResizeRecomputeConfig = Field(default_factory=ResizeRecomputeConfig)
    swap_attention: SwapAttentionConfig = Field(default_factory=SwapAttentionConfig)
    tiled: TiledConfig = Field(default_factory=TiledConfig)
    lean_cross_entropy: bool | None = Field(
        None, description="The model's own F.cross_entropy calls over (tokens, classes) logits with class targets "
                          "(a loss computed in its forward) run by blocks of rows while the engine's forward runs: "
                          "bitwise the same loss and gradients, one logits' worth less memory at the loss's "
                          "backward (zeroplus/activations/lean_loss.py); false: torch's own. Unset: on, and "
                          "where techniques_by_default is 'where_needed' only where the run needs its memory.")
    embedding_rows: bool | None = Field(
        None, description="An embedding lookup's gradient (a tied table's, or a root unit's plain lookup) goes to the "
                          "engine as one summed row per token instead of autograd's dense table-sized gradient, "
                          "reduced sparsely at stages 2-3 (zeroplus/zero/use_grads.py): no vocabulary x hidden "
                          "temporary in backward, for a sort and scatter of the tokens; false: autograd's dense "
                          "gradient, added into the flat gradient as any other use. Unset: on, and where "
                          "techniques_by_default is 'where_needed' only where the run needs its memory.")
    techniques_by_default: Literal["auto", "where_they_pay", "where_needed"] = Field(
        "auto", description="Which memory techniques left unset (resize_recompute.enabled, lean_cross_entropy, "
                            "embedding_rows) run: 'where_they_pay' (the lean loss and embedding rows on, resize "
                            "recompute where it takes 1% or more off the predicted peak), 'where_needed' (only where "
                            "the predicted peak without them passes 95% of this rank's memory: memory_budget, else the"
                            " device's), 'auto': the device's (CPU: where they pay, at 3-17% of a step at 4 x 256; "
                            "CUDA and NPU: where needed). Decided at the first forward from the memory estimate (see "
                            "note: techniques by default).")
    fused_ops: bool | Literal["compiled", "liger", "fastest"] = Field(
        False, description="The Llama family's RMSNorms and gated (SwiGLU) MLPs run the device's fused kernels "
                           "(zeroplus/fused_ops.py): bitwise equal to eager, fewer tensors kept for "
                           "backward; refused in a model with neither. \"compiled\" (CPU and CUDA): their "
                           "reference functions compiled by torch.compile (inductor), the fastest on this "
                           "CPU, rounding as inductor does (not eager's bits), a compile per process and shape. "
                           "\"liger\" (CUDA, liger_kernel installed): Liger's Triton kernels. \"fastest\": "
                           "the fastest measured per device (CUDA: Liger where installed, else compiled; CPU: "
                           "compiled; NPU: its fused operators).")
    activation_tier: ActivationTierConfig = Field(default_factory=ActivationTierConfig)
    direct_io: bool = Field(
        True, description="Offload and swap files bypass the page cache (O_DIRECT, aligned buffers) where the "
                          "filesystem allows; false: buffered files.")
    virtual_optimizer_states: bool = Field(
        False, description="Ascend NPU only: AdamW states in host memory mapped into the device's address space "
                           "(torch_npu.empty_with_swapped_memory), stepped in place, no swap streams.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    memory_budget: str | int | None = Field(
        None, description="Bytes per rank ('16GB', '16GiB' or a number): initialize refuses a config predicted to "
                          "exceed it, and resolves 'auto' in zero_optimization.stage, offload_optimizer.ratio, "
                          "shared_master_weights and resize_recompute.enabled to the cheapest choice that fits. Set on "
                          "every rank or none; where the ranks' values differ, each trains in the smallest.")
    seq_len: PositiveInt | None = Field(
        None, description="Tokens per sequence the memory budget is planned for (the planner runs before any input).")
    memory_estimate: bool = Field(
        True, description="At the first forward, predict this rank's memory per category and phase (the engine run "
                          "on the meta device, as zeroplus.estimate does) and report it beside what is measured.")
    collective_timeout: PositiveFloat = Field(
        600.0, description="Seconds any collective may wait for the other ranks before every waiting rank raises, "
                           "naming the collective and the rank that did not arrive; applied to the process groups "
                           "zeroplus creates (torch's own default is 30 minutes).")
    link_ratio: PositiveFloat = Field(
        8.0, description="How many times faster a node's own links are than those between nodes: the planner weighs "
                         "each layout's bytes within and across nodes by it ('auto' in mics_shard_size or "
                         "zero_hpz_partition_size).")
    quantized_gradient_bits: Literal[8, 4] = Field(
        8, description="Bits a code of qgZ's gradient reduce-scatter (zero_optimization.zero_quantized_gradients): "
                       "8 (each rank's error within max|block| / 254) or 4, as DeepSpeed's qgZ sends (within "
                       "max|block| / 14, two codes a byte: half the bytes).")
    quantized_weights_dtype: Literal["int8", "fp8", "bf16"] = Field(
        "int8", description="Codes of qwZ's weight gathers (zero_optimization.zero_quantized_weights): int8 with a "
                            "scale per 256 elements (each weight within max|block| / 254), fp8 (e4m3, a power-of-two "
                            "scale per 128: within |w| / 16) or bf16 (within |w| / 256: FSDP2's param_dtype for fp32 "
                            "masters); the shards stay exact. bf16 in a bf16 compute dtype gathers exactly.")
    node_size: PositiveInt | None = Field(
        None, description="Ranks per node (consecutive global ranks, as torchrun numbers them), for the comms log's "
                          "split of bytes within and across nodes and qgZ's two levels; unset: the launch's "
                          "LOCAL_WORLD_SIZE, else every rank on one node.")
    transport: Literal["auto", "native", "gloo", "pair"] = Field(
        "auto", description="How the data-parallel group's all-gathers and gradient reductions move bytes, chosen "
                            "when the engine is assembled: native (the tensor collectives, one launch each, as NCCL "
                            "and HCCL run them; on gloo too), gloo (per-rank in-place broadcasts and reduces, two "
                            "ranks exchanging rows), pair (gloo with two ranks of one x86-64 host swapping through "
                            "shared memory), auto (native on a GPU or NPU; pair or gloo on CPU ranks, as "
                            "shared_memory_pair allows).")
    shared_memory_pair: bool = Field(
        True, description="Two data-parallel gloo ranks on one x86-64 host swap their large all-gathers, gradient "
                          "exchanges and reductions through a 4 MiB shared-memory mapping instead of TCP loopback "
                          "(about twice as fast, the bytes the same); false keeps gloo for everything (so does "
                          "ZEROPLUS_SHM_PAIR=0).")
    overlap_param_gather: bool = Field(
        False, description="Stages 1-2: the all-gathers of the stepped parameters that step() starts are waited for "
                           "by each unit's next forward instead of before step() returns, so later units' gathers "
                           "overlap earlier units' compute. Until that forward (or engine.module, or state_dict()) "
                           "the parameter tensors of the model object, read directly, mix values from before and "
                           "after the step (this rank's shard is current, the rest is not); false (the default): "
                           "step() returns with every parameter current, as DDP and DeepSpeed do.")
    dump_dir: str | None = Field(
        None, description="Where a rank writes what it was doing when a collective fails or memory runs out "
                          "(default: $ZEROPLUS_DUMP_DIR, else <temp dir>/zeroplus-dumps).")
    memory_history: bool = Field(
        False, description="CUDA: record the allocator's history from the start, dumped beside the out-of-memory "
                           "file for PyTorch's memory viz (costs allocator time).")
    async_save: bool = Field(
        False, description="Training checkpoints are saved asynchronously: save_checkpoint returns once this "
                            "rank's state is staged in host memory (one rank file's worth, in the ledger's "
                            "offload_buffer and the budget); the file and the commit follow in the background.")
    checkpoint_format: Literal["zeroplus", "dcp"] = Field(
        "zeroplus", description="What save_checkpoint writes: 'zeroplus' (its own sharded files: checksummed, "
                                "resumed bit-exactly with RNG, schedule and client state) or 'dcp' (a "
                                "torch.distributed.checkpoint in FSDP2's layout, for FSDP2 and torchtitan; model, "
                                "optimizer states and hyper-parameters only). load_checkpoint reads both.")
    keep_latest_k: PositiveInt | None = Field(
        None, description="Training checkpoints kept in a save directory: after each save commits, older ones beyond "
                          "the k newest are removed (never the one 'latest' names). Unset: all are kept.")
    peak_tflops: float | None = Field(
        None, gt=0, description="Peak TFLOP/s of one device in the compute dtype, for the FLOPs profiler's MFU "
                                "(default: the datasheet's for known GPUs and NPUs, a measured matmul on CPU).")
    master_step_chunk: PositiveInt = Field(
        1 << 20, description="Elements per chunk when the optimizer steps a shared (split) master; at one rank, the "
                              "largest piece an optimizer that is not fused steps of a parameter (rounded down to "
                              "1024s).")

    @field_validator("unit_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("zeroplus.unit_modules must name at least one module class, or be left out")
        return value
