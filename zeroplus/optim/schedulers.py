"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle).

Same semantics as DeepSpeed 0.19: the schedule is built at iteration -1 and its first ``step()``
moves it to iteration 0; the engine steps it after every optimizer step that was not skipped.
One difference: ``warmup_num_steps: 0`` means "no warm-up" instead of an error.
Each schedule has ``step``, ``get_lr``, ``get_last_lr``, ``state_dict`` and ``load_state_dict``.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"scheduler.params.{name} has {len(value)} values for "
                             f"{len(optimizer.param_groups)} optimizer param groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)


class _Schedule:
    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = self._apply()

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = self._apply()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._apply()


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float | None:
    """Progress through warm-up in [0, 1), or None once warm-up is over (or there is none)."""
    if warmup_num_steps == 0 or iteration >= warmup_num_steps:
        return None
    if warmup_type == "linear":
        return iteration / warmup_num_steps
    return math.log(iteration + 1) / math.log(warmup_num_steps)


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    if warmup_num_steps < 0:
        raise ValueError(f"scheduler.params.warmup_num_steps must be >= 0, got {warmup_num_steps}")
    return 0 if warmup_num_steps == 0 else max(2, int(warmup_num_steps))


class WarmupLR(_Schedule):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then stays."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        max_lr = warmup_max_lr if warmup_max_lr is not None else [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, max_lr, "warmup_max_lr")
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self) -> float:
        fraction = _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0 if fraction is None else fraction

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0 and self.warmup_num_steps > 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to warmup_min_lr at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        if total_num_steps < 1:
            raise ValueError(f"scheduler.params.total_num_steps must be >= 1, got {total_num_steps}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        fraction = _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        if fraction is not None:
            return fraction
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """lr ratio rises from warmup_min_ratio to 1, then follows a cosine down to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def _ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0 if self.warmup_num_steps > 0 else 1.0
        fraction = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        if fraction is not None:
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self._ratio()
        return [lr * ratio for lr in self.base_lrs]


class OneCycle(_Schedule):
    """1-cycle policy: lr up from cycle_min_lr to cycle_max_lr and back, then decay; momentum mirrors it."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: int | None = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError(f"scheduler.params.cycle_first_step_size must be > 0 and cycle_second_step_size >= 0, "
                             f"got {cycle_first_step_size} and {cycle_second_step_size}")
        self.first, self.second, self.total = first, second, first + second
        self.step_ratio = first / self.total
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total)
        x = 1.0 + it / self.total - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stairs
        if stairs > 0:
            pos = it % self.total
            position = pos * stairs / self.first if pos <= self.first else (self.total - pos) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decay_factor(self, rate: float) -> float | None:
        if math.isclose(self.decay_step_size, 0) or math.isclose(rate, 0):
            return None
        return 1 + rate * (self.last_batch_iteration - self.total + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        if self.last_batch_iteration < self.total:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        factor = self._decay_factor(self.decay_lr_rate)
        return list(self.min_lrs) if factor is None else [lo / factor for lo in self.min_lrs]

    def _apply(self) -> list[float]:
        lrs = super()._apply()
        if self.cycle_momentum:
            if self.last_batch_iteration < 0:
                moms = self.min_moms
            elif self.last_batch_iteration < self.total:
                s = self._scale()
                moms = [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
            else:
                factor = self._decay_factor(self.decay_mom_rate)
                moms = self.max_moms if factor is None else [m * factor for m in self.max_moms]
            for group, mom in zip(self.optimizer.param_groups, moms):
                group["betas"] = (mom, 0.99)  # DeepSpeed's OneCycle pins beta2 at 0.99
        return lrs


SCHEDULES = {"warmuplr": WarmupLR, "warmupdecaylr": WarmupDecayLR, "warmupcosinelr": WarmupCosineLR,
             "onecycle": OneCycle}


def build_scheduler(type_name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> _Schedule:
    cls = SCHEDULES.get(type_name.lower())
    if cls is None:
        raise ValueError(f"scheduler.type {type_name!r} is not supported; choose one of "
                         f"WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle")
    try:
        return cls(optimizer, **params)
    except TypeError as err:
        raise ValueError(f"scheduler.params for {type_name}: {err}") from None
