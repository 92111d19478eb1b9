"""Rank-aware logging: every record carries ``[rank N]``; ``log_rank0`` speaks once for all ranks."""
from __future__ import annotations

import logging

import torch.distributed as dist

logger = logging.getLogger("zeroplus")


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _RankFilter(logging.Filter):
    """Tags records with the rank; config resolutions are the same on every rank, so only rank 0 logs them."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__["rank"] = this_rank = rank()  # read by the format's %(rank)s
        return not (record.name == "zeroplus.config" and this_rank != 0)


def setup_logging(level: str = "info") -> None:
    """Install one handler on the ``zeroplus`` logger (idempotent)."""
    if not any(getattr(h, "_zeroplus", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._zeroplus = True  # type: ignore[attr-defined]
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[zeroplus rank %(rank)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


def log_rank0(msg: str, *args: object, level: int = logging.INFO) -> None:
    if rank() == 0:
        logger.log(level, msg, *args)
