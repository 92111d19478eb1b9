"""Config blocks of what a run reports beside training: the communication log, the FLOPs profiler, the monitors.

DeepSpeed's ``"comms_logger"``, ``"flops_profiler"``, ``"tensorboard"``, ``"csv_monitor"``, ``"wandb"`` and
``"comet"``.

Each is read by an observer the engine attaches when the block is enabled (``engine/watch.py``); none changes
what is trained. Strict as every block (``blocks.Block``).
"""
from __future__ import annotations

from pydantic import Field

from .blocks import Block, PositiveInt


class CommsLoggerConfig(Block):
    """DeepSpeed's ``"comms_logger"`` block (``zeroplus/comms_log.py``)."""

    enabled: bool = Field(False, description="Record every collective: count, bytes, time, algbw and busbw per kind "
                                             "and group; engine.comms_summary() and deepspeed.comm.log_summary() "
                                             "print it.")
    verbose: bool = Field(False, description="Also log each collective as it completes.")
    prof_all: bool = Field(True, description="Record every kind of collective; false: only those in prof_ops.")
    prof_ops: list[str] = Field(default_factory=list, description="The kinds recorded when prof_all is false "
                                                                  "(all_reduce, all_gather_into_tensor, ...).")
    debug: bool = Field(False, description="DeepSpeed's caller names in the log; not read.")


class FlopsProfilerConfig(Block):
    """DeepSpeed's ``"flops_profiler"`` block (``engine/flops_profiler.py``)."""

    enabled: bool = Field(False, description="Count the FLOPs of one training step (torch's FlopCounterMode on the "
                                             "real step) and report TFLOP/s and MFU every steps_per_print steps.")
    profile_step: PositiveInt = Field(1, description="The optimizer step (1-based) whose FLOPs are counted.")
    module_depth: int = Field(-1, description="Module levels in the profile; -1: all.")
    top_modules: PositiveInt = Field(1, description="The largest modules listed at each level.")
    detailed: bool = Field(True, description="DeepSpeed's per-module listing; the profile always lists modules.")
    output_file: str | None = Field(None, description="Also write the profile to this file (rank 0).")
    recompute_fwd_factor: float = Field(0.0, description="DeepSpeed's estimate of recomputed forwards; not read: "
                                                         "recomputation is counted as it runs.")


class TensorBoardConfig(Block):
    """DeepSpeed's ``"tensorboard"`` block (``engine/monitors.py``)."""

    enabled: bool = Field(False, description="Rank 0 writes the training events with torch.utils.tensorboard.")
    output_path: str = Field("", description="Directory of the event files (job_name inside it).")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory of output_path for this run.")


class CsvMonitorConfig(Block):
    """DeepSpeed's ``"csv_monitor"`` block (``engine/monitors.py``)."""

    enabled: bool = Field(False, description="Rank 0 writes one CSV file per training event.")
    output_path: str = Field("", description="Directory of the CSV files (job_name inside it).")
    job_name: str = Field("DeepSpeedJobName", description="Sub-directory of output_path for this run.")


class WandbConfig(Block):
    """DeepSpeed's ``"wandb"`` block (``engine/monitors.py``; WANDB_MODE=offline keeps the run on disk)."""

    enabled: bool = Field(False, description="Rank 0 logs the training events to Weights & Biases.")
    group: str | None = Field(None, description="wandb.init's group.")
    team: str | None = Field(None, description="wandb.init's entity.")
    project: str = Field("deepspeed", description="wandb.init's project.")


class CometConfig(Block):
    """DeepSpeed's ``"comet"`` block (``engine/monitors.py``)."""

    enabled: bool = Field(False, description="Rank 0 logs the training events to Comet (comet_ml).")
    samples_log_interval: PositiveInt = Field(100, description="DeepSpeed's; events are logged every step here.")
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None
