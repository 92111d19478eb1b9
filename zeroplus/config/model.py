"""The top-level config model: DeepSpeed's keys plus the ``"zeroplus"`` block."""
from __future__ import annotations

import math
import sys
from typing import Any, ClassVar

from pydantic import Field, field_validator

from .blocks import (
    ActivationCheckpointingConfig,
    Auto,
    Block,
    CheckpointConfig,
    ExpertParallelConfig,
    NonNegativeFloat,
    OptimizerConfig,
    PositiveInt,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
    ZeroplusBlock,
)
from .observe_blocks import (
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .precision_blocks import BF16Config, FP16Config


class ZeroplusConfig(Block):
    """A whole training config. Batch fields are ``None`` until ``resolve_batch`` fills them."""

    ds_unimplemented: ClassVar[frozenset[str]] = frozenset({
        "amp",
        "compression_training", "data_efficiency", "curriculum_learning", "elasticity", "autotuning", "aio",
        "data_types", "dump_state", "sparse_attention", "sparse_gradients", "pipeline",
        "communication_data_type",
        "seq_parallel_communication_data_type", "prescale_gradients", "gradient_predivide_factor",
        "disable_allgather", "fp32_allreduce", "eigenvalue", "progressive_layer_drop", "quantize_training",
        "timers", "nebula", "hybrid_engine", "graph_harvesting", "weight_quantization", "torch_autocast",
        "compile", "use_node_local_storage", "load_universal_checkpoint",
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
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    steps_per_print: int = Field(10, ge=1, description="Log every N optimizer steps; inf (Accelerate sets it): never.")
    zero_allow_untested_optimizer: bool = Field(
        True, description="DeepSpeed's permission to partition a client optimizer; zeroplus partitions any torch "
                          "optimizer, so this has no effect.")
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="DeepSpeed's demand for its CPU Adam under offload; zeroplus runs the client's optimizer "
                          "where the states are, so this has no effect.")
    dataloader_drop_last: bool = Field(
        False, description="The DeepSpeed API's training_data loader drops the last incomplete micro-batch.")
    wall_clock_breakdown: bool = Field(
        False, description="Time forward, backward (compute and reduction waits), the optimizer step, stage 3's "
                           "gather waits and offload waits; logged every steps_per_print steps on rank 0 "
                           "(engine/step_timers.py).")
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    memory_breakdown: bool = False
    zeroplus: ZeroplusBlock = Field(default_factory=ZeroplusBlock)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _never(cls, value: Any) -> Any:
        return sys.maxsize if isinstance(value, float) and math.isinf(value) and value > 0 else value
