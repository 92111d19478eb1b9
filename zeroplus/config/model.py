"""The top-level config model: DeepSpeed's keys plus the ``"zeroplus"`` block."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from .blocks import (
    ActivationCheckpointingConfig,
    Auto,
    BF16Config,
    Block,
    FP16Config,
    NonNegativeFloat,
    OptimizerConfig,
    PositiveInt,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
    ZeroplusBlock,
)


class ZeroplusConfig(Block):
    """A whole training config. Batch fields are ``None`` until ``resolve_batch`` fills them."""

    ds_unimplemented: ClassVar[frozenset[str]] = frozenset({
        "amp", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
        "compression_training", "data_efficiency", "curriculum_learning", "elasticity", "autotuning", "aio",
        "checkpoint", "data_types", "dump_state", "sparse_attention", "sparse_gradients", "pipeline",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "communication_data_type",
        "seq_parallel_communication_data_type", "prescale_gradients", "gradient_predivide_factor",
        "disable_allgather", "fp32_allreduce", "eigenvalue", "progressive_layer_drop", "quantize_training",
        "timers", "nebula", "hybrid_engine", "graph_harvesting", "weight_quantization", "torch_autocast",
        "compile", "use_node_local_storage", "load_universal_checkpoint", "dataloader_drop_last",
        "optimizer_legacy_fusion", "zero_optimization_stage_3_legacy", "sequence_parallel_size",
    })
    train_batch_size: PositiveInt | Auto | None = None
    train_micro_batch_size_per_gpu: PositiveInt | Auto | None = None
    gradient_accumulation_steps: PositiveInt | Auto | None = None
    gradient_clipping: NonNegativeFloat | Auto = Field(0.0, description="Max global grad norm; 0 disables.")
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, json_schema_extra={"aliases": ["bfloat16"]})
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    steps_per_print: int = Field(10, ge=1)
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    zeroplus: ZeroplusBlock = Field(default_factory=ZeroplusBlock)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
