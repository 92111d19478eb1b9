"""Monitors (DeepSpeed's ``"tensorboard"``, ``"csv_monitor"``, ``"wandb"`` and ``"comet"`` blocks): the training
events rank 0 writes at every optimizer step.

Events are ``(name, value, samples)`` triples, the x-axis the samples trained so far (``global_samples``), as
DeepSpeed writes them. DeepSpeed's names where it has them: ``Train/Samples/lr`` (the first param group's),
``Train/Samples/loss_scale`` (fp16), ``Train/Samples/train_loss`` (the mean of the losses given to
``backward()`` in the step) and, every ``steps_per_print`` steps with ``wall_clock_breakdown``,
``Train/Samples/elapsed_time_ms_forward``, ``_backward``, ``_backward_inner``, ``_backward_allreduce`` and
``_step`` (means per step). What DeepSpeed's engine does not log: ``Train/Samples/grad_norm`` every step;
every ``steps_per_print`` steps ``Train/Samples/samples_per_second``, ``Train/Samples/tokens_per_second`` (the
token count: the largest integer tensor given to forward), ``Train/Samples/mfu`` and ``Train/Samples/tflops``
(with ``flops_profiler``), the breakdown's ``gather_wait_ms`` and ``offload_wait_ms``, and the memory per
category, ``Memory/measured_peak_bytes/CATEGORY`` and, once a budget was predicted,
``Memory/predicted_peak_bytes/CATEGORY``.

Writers: TensorBoard (``torch.utils.tensorboard``, into ``output_path/job_name``), CSV (one file per event in
``output_path/job_name``, named after the event with ``/`` as ``_``, a ``step,NAME`` header, DeepSpeed's
layout), Weights & Biases (``wandb.init(project, group, entity=team)``; ``WANDB_MODE=offline`` keeps it on
disk) and Comet (``comet_ml.start``). Only rank 0 writes; every rank checks at ``initialize`` that the package
an enabled block needs is installed, and a missing one is a ``ConfigError`` naming the key and the package.
Memory: the writers' buffers; the step's loss is summed on the device and read once per step.
"""
from __future__ import annotations

import csv
import importlib.util
import os
from typing import Any, Protocol

from zeroplus.config import ConfigError

Event = tuple[str, float, int]
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


class Writer(Protocol):
    def write(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter
        os.makedirs(directory, exist_ok=True)
        self.writer = SummaryWriter(log_dir=directory)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.writer.add_scalar(name, value, samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvWriter:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.started: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.directory, filename + ".csv"), "a", newline="") as f:
                out = csv.writer(f)
                if filename not in self.started:
                    self.started.add(filename)
                    out.writerow(["step", name.rsplit("/", 1)[-1]])
                out.writerow([samples, value])

    def close(self) -> None:
        return None


class WandbWriter:
    def __init__(self, block: Any) -> None:
        import wandb
        self.run = wandb.init(project=block.project, group=block.group, entity=block.team)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.run.log({name: value, "samples": samples})

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    def __init__(self, block: Any) -> None:
        import comet_ml
        self.experiment = comet_ml.start(api_key=block.api_key, project=block.project, workspace=block.workspace,
                                         experiment_key=block.experiment_key,
                                         mode=block.mode, online=block.online)
        if block.experiment_name:
            self.experiment.set_name(block.experiment_name)

    def write(self, events: list[Event]) -> None:
        for name, value, samples in events:
            self.experiment.log_metric(name, value, step=samples)

    def close(self) -> None:
        self.experiment.end()


def check_packages(config: Any, rank: int) -> None:
    """Every rank, at ``initialize``: each enabled monitor's package is importable."""
    for key, package in PACKAGES.items():
        if getattr(config, key).enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(f"config key '{key}.enabled' is true but the package {package!r} is not installed "
                              f"(rank {rank}): pip install {package.replace('_', '-')}, or disable the monitor")


class Monitors:
    """The enabled writers (rank 0), fed the events of each step."""

    def __init__(self, config: Any, rank: int) -> None:
        check_packages(config, rank)
        self.writers: list[Writer] = []
        if rank != 0:
            return
        if config.tensorboard.enabled:
            self.writers.append(TensorBoardWriter(os.path.join(config.tensorboard.output_path,
                                                               config.tensorboard.job_name)))
        if config.csv_monitor.enabled:
            self.writers.append(CsvWriter(os.path.join(config.csv_monitor.output_path, config.csv_monitor.job_name)))
        if config.wandb.enabled:
            self.writers.append(WandbWriter(config.wandb))
        if config.comet.enabled:
            self.writers.append(CometWriter(config.comet))

    @staticmethod
    def wanted(config: Any) -> bool:
        return any(getattr(config, key).enabled for key in ("tensorboard", "csv_monitor", "wandb", "comet"))

    def write(self, events: list[Event]) -> None:
        for writer in self.writers:
            writer.write(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers.clear()
