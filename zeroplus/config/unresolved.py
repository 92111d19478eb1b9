"""The ``"auto"`` values nothing will fill: one error naming all of them, and who fills them.

Hugging Face's DeepSpeed templates leave the batch sizes, clipping and the optimizer's and
scheduler's parameters ``"auto"``: the Trainer or Accelerate writes its own arguments into them
before calling DeepSpeed's ``initialize``. zeroplus derives what it can itself (the batch triple
from two of its members and the data-parallel size, bucket sizes from the hidden size, fp16/bf16
from the model's dtype, warm-up bounds from the learning rate), and its planner fills its own keys
within ``zeroplus.memory_budget``. ``check_fillable`` runs before any of that and lists the rest at
once, so a template passed straight to ``zeroplus.initialize`` fails with every key to fill, not
with the first one the resolution trips on.
"""
from __future__ import annotations

from .keys import ConfigError
from .model import ZeroplusConfig
from .resolve import SCHEDULER_KEYS_AT_ZERO, SCHEDULER_KEYS_FROM_LR, auto_keys

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def unfillable_autos(cfg: ZeroplusConfig) -> list[str]:
    """Dotted keys whose ``"auto"`` nothing in zeroplus can resolve for this config."""
    keys: list[str] = []
    batch = {key: getattr(cfg, key) for key in _BATCH}
    given = {key for key, value in batch.items() if value not in (None, "auto")}
    if not given & {"train_batch_size", "train_micro_batch_size_per_gpu"}:
        keys += [key for key, value in batch.items() if value == "auto"]
    if cfg.gradient_clipping == "auto":
        keys.append("gradient_clipping")
    lr = cfg.optimizer.params.get("lr") if cfg.optimizer is not None else None
    if lr == "auto":
        keys.append("optimizer.params.lr")
    if cfg.scheduler is not None:
        for key, value in cfg.scheduler.params.items():
            derivable = key in SCHEDULER_KEYS_AT_ZERO or (key in SCHEDULER_KEYS_FROM_LR and lr not in (None, "auto"))
            if value == "auto" and not derivable:
                keys.append(f"scheduler.params.{key}")
    if cfg.zeroplus.memory_budget is None:
        keys += auto_keys(cfg)
    return keys


def check_fillable(cfg: ZeroplusConfig) -> None:
    """Raise one ``ConfigError`` naming every ``"auto"`` key left unfilled, and what fills each kind."""
    keys = unfillable_autos(cfg)
    if not keys:
        return
    planner = set(auto_keys(cfg))
    template = [k for k in keys if k not in planner]
    parts = [f"config keys are \"auto\" and nothing here fills them: {_quoted(keys)}."]
    if template:
        parts.append("These are Hugging Face template placeholders: the Trainer (TrainingArguments(deepspeed=...)) "
                     "or Accelerate's DeepSpeedPlugin writes its own arguments into them before DeepSpeed's "
                     "initialize, so run such a script unchanged with `zeroplus run --deepspeed-api` (or "
                     "`python -m zeroplus.deepspeed_api`); called directly, zeroplus.initialize needs a value for "
                     + ("each of them." if template == keys else f"each of {_quoted(template)}."))
    if planner & set(keys):
        parts.append(f"{_quoted([k for k in keys if k in planner])}: the planner fills these within "
                     "'zeroplus.memory_budget' (e.g. \"16GB\"); set it or give values.")
    raise ConfigError(" ".join(parts))


def _quoted(keys: list[str]) -> str:
    return ", ".join(f"'{key}'" for key in keys)
