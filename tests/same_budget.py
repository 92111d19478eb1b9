"""Two processes' budgets for the same run: equal but for MKL's buffer pool.

The pool's figure is what emptying it gives back after a replay of the run's products (``zeroplus/host_gemm_pool.py``),
and on an Intel Xeon with AVX-512 that moved between processes forked alike: 64-244 KiB for the same products and
MKL's same count (2026-12-07; the part of a buffer a product writes follows where its operands lie). Every ledger
category is then equal bit for bit, and ``runtime`` (with ``total``) within ``POOL_SPREAD``.
"""
from __future__ import annotations

POOL_SPREAD = 512 * 1024  # bytes: twice the spread measured


def assert_same_phases(got: dict, expected: dict, where: str = "") -> None:
    """``got`` and ``expected`` (a budget's ``phases``) equal in every category, ``runtime`` within ``POOL_SPREAD``."""
    assert got.keys() == expected.keys(), where
    for phase, row in expected.items():
        tensors = {k: v for k, v in row.items() if k not in ("runtime", "total")}
        assert {k: v for k, v in got[phase].items() if k not in ("runtime", "total")} == tensors, (where, phase)
        assert abs(got[phase]["runtime"] - row["runtime"]) <= POOL_SPREAD, (where, phase, got[phase], row)
        assert got[phase]["total"] - got[phase]["runtime"] == row["total"] - row["runtime"], (where, phase)
