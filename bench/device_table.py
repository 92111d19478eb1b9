"""The one-GPU table of ``docs/benchmark.md`` ("One GPU") from the device run's figures.

``tests/device/run_on_device.sh`` writes ``one_gpu_<dtype>.json`` (the rows ``bench_zero.py --json-file`` writes: plain
module, DDP, FSDP2 stages 2-3, zeroplus stages 0-3; GPT 111M x 512, peak = the device allocator's above the model)
under its ``$OUT``; this prints them as the markdown table the section holds, with the issue's two ratios per row:
the step's speed against the plain module with fused AdamW (target >= 0.95 for zeroplus at one rank) and the peak
against FSDP2's at the same stage (ZeRO-3 target <= 0.85).

    python bench/device_table.py device-out/one_gpu_fp32.json device-out/one_gpu_bf16.json
"""
from __future__ import annotations

import json
import os
import sys


def rows_of(path: str) -> tuple[str, list[dict]]:
    """(dtype, rows) of one figures file (``one_gpu_<dtype>.json``)."""
    with open(path) as f:
        rows = json.load(f)
    return os.path.basename(path).removeprefix("one_gpu_").removesuffix(".json"), rows


def table(files: list[str]) -> str:
    out = ["| dtype | row | step ms | x plain speed | peak MiB | x FSDP2 peak |", "|---|---|---|---|---|---|"]
    for path in files:
        dtype, rows = rows_of(path)
        plain = next((r for r in rows if r["framework"] == "plain"), None)
        fsdp = {r["stage"]: r for r in rows if r["framework"] == "fsdp2"}
        for r in rows:
            speed = f"{plain['step_s'] / r['step_s']:.2f}" if plain else "-"
            peer = fsdp.get(r["stage"]) if r["framework"] == "zeroplus" else None
            peak = r["peak_gib"] * 1024
            vs = f"{peak / (peer['peak_gib'] * 1024):.2f}" if peer else "-"
            name = r["framework"] if r["framework"] in ("plain", "ddp") else f"{r['framework']} {r['stage']}"
            out.append(f"| {dtype} | {name} | {1e3 * r['step_s']:.1f} | {speed} | {peak:.0f} | {vs} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(table(sys.argv[1:]))


if __name__ == "__main__":
    main()
