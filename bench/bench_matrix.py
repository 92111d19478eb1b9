"""Benchmark: the variation matrix every memory and budget target is measured over, with its worst cells.

A figure measured on one setup is an anecdote: this runs ZeRO-3 (zeroplus) and FSDP2 over what users vary
and reports each cell and the worst. Axes (each a comma list; the default is every value, the full
factorial):

- ``--models``: ``nn`` (the user's GPT of ``bench_harness.py``, 111M, from ``torch.nn`` layers), ``own`` (the
  same GPT from its own ``Linear``/``LayerNorm``/``Embedding`` classes), ``llama`` and ``mixtral`` (Hugging
  Face, ``tests/hf_models.py`` size ``small``: 44M and 53M, the MoE with 4 experts, top 2);
- ``--dtypes``: ``fp32``, ``bf16`` (bf16 is skipped where the CPU emulates it, and the table says so);
- ``--allocs``: ``left`` (the process started as a user starts it: glibc and oneDNN's kernel caches as they are;
  zeroplus's default then returns freed memory and bounds the caches itself, ``host_allocator``,
  ``host_kernel_cache``; FSDP2 has glibc keep it and the caches grow) and ``return`` (the process tuned:
  ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` 131072 and the caches bounded as zeroplus bounds them,
  for both);
- ``--optimizers``: ``config`` (DeepSpeed's JSON names AdamW) and ``client`` (``torch.optim.AdamW`` passed to
  ``initialize``, no optimizer block); FSDP2 always has its client AdamW;
- ``--overlap``: DeepSpeed's ``overlap_comm`` ``true``/``false`` (FSDP2 has no such key: one FSDP2 cell
  serves both);
- ``--ranks``: ``1,2,4`` gloo ranks; ``--batches``: ``1x64,4x256`` (micro-batch x sequence).

Per cell, each rank: the peak resident memory above the process just before the model is built (VmHWM;
max over ranks), the median step time (steps 3 on), and for zeroplus its own figures as a user reads them
(``engine.memory_report()``: the predicted peak beside the measured one above ``initialize``'s start, the
first-forward prediction the log prints). FSDP2 is given its best honest configuration: ``fully_shard`` per
block (decoder layer) and root, ``reshard_after_forward`` default, bf16 as ``MixedPrecisionPolicy(bf16,
reduce_dtype=fp32)``, ``clip_grad_norm_``, ``zero_grad(set_to_none=True)``, and measured in each cell both with
glibc as left and returning freed memory: the ratio is to the lower (FSDP2's best), the column beside it FSDP2 with
the cell's own glibc. The table ends with the worst ratio, the worst and the median budget error (absolute), each
with its cell, and for each cell over the target its reason from zeroplus's ledger (``reason``): what the ledger held
when its total peaked on the rank with the highest peak, by category, the model states' ratio to FSDP2's best alone
(over the target: no activation technique brings the cell under it), and what the process held beyond the ledger.

    python bench/bench_matrix.py                                   # the whole matrix (hours on 2 cores)
    python bench/bench_matrix.py --models own --ranks 2 --batches 1x64 --json runs/matrix.jsonl
    python bench/bench_matrix.py --table runs/matrix.jsonl         # the table of what a file holds

``--json FILE`` appends every cell as it is measured and skips the cells the file holds already, so a long
run continues where it stopped; ``--table FILE`` prints the table of a file without running anything.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# allocs "return": a process tuned by its user (glibc returning freed memory, oneDNN's kernel caches bounded)
TUNED_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072",
             "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "16"}
# what a user's process does not start with: this process's own settings (import zeroplus sets the caches' variables)
_NOT_INHERITED = ("ZEROPLUS_HOST_ALLOCATOR", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
AXES = {"models": ("nn", "own", "llama", "mixtral"), "dtypes": ("fp32", "bf16"), "allocs": ("left", "return"),
        "optimizers": ("config", "client"), "overlap": ("true", "false"), "ranks": ("1", "2", "4"),
        "batches": ("1x64", "4x256")}
TARGET_RATIO, TARGET_ERROR, TARGET_MEDIAN_ERROR = 0.85, 5.0, 2.0  # issue targets: x FSDP2; budget error in %
STEPS = 6


def build(model: str, seq: int, scale: str = "bench") -> Any:
    """The cell's model, built after the measured start; ``scale`` "test": the suite's small sizes (the GPT at
    21M, the Hugging Face models ``tiny``)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    sys.path.insert(0, ROOT)
    if model in ("nn", "own"):
        from bench_harness import user_gpt
        return user_gpt(model, seq, "test" if scale == "test" else "111m")
    from tests.hf_models import build as hf_build
    return hf_build(model, "tiny" if scale == "test" else "small", max_positions=max(seq, 64))


def worker(engine: str, cell: dict[str, str], out: str) -> None:
    """One rank of one cell: its framework imported, the measured start, the model, ``STEPS`` steps."""
    import torch
    import torch.distributed as dist

    if engine == "zeroplus":
        import zeroplus
    else:
        import torch.distributed.fsdp  # noqa: F401 - before the measured start
    if cell["models"] in ("llama", "mixtral"):
        import transformers  # noqa: F401 - a script imports its model classes before building the model

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from bench_harness import fsdp2_step  # (torch only: the measured start is still ahead)
    from bench_worker import rss_bytes, start_measuring

    micro, seq = (int(v) for v in cell["batches"].split("x"))
    bf16 = cell["dtypes"] == "bf16"
    rank, start = start_measuring()
    model = build(cell["models"], seq, cell.get("scale", "bench"))
    hf = cell["models"] in ("llama", "mixtral")
    vocab = model.config.vocab_size if hf else model.head.weight.shape[0]
    blocks = model.model.layers if hf else model.blocks
    report: dict[str, Any] = {}
    if engine == "fsdp2":
        step = fsdp2_step(model, blocks, bf16, lambda m, x: m(input_ids=x, labels=x).loss if hf else m(x, x))
    else:
        client = cell["optimizers"] == "client"
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "overlap_comm": cell["overlap"] == "true"},
            "bf16": {"enabled": bf16}, "steps_per_print": 10**6, "zeroplus": {"log_level": "warning"}}
        if not client:
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}
        engine_ = zeroplus.initialize(model, cfg,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4) if client else None)

        def step(x: torch.Tensor) -> float:
            loss = engine_(input_ids=x, labels=x).loss if hf else engine_(x, x)
            engine_.backward(loss)
            engine_.step()
            return loss.item()
    g = torch.Generator().manual_seed(rank)
    times, losses = [], []
    for _ in range(STEPS):
        x = torch.randint(0, vocab, (micro, seq), generator=g)
        t0 = time.perf_counter()
        losses.append(step(x))
        times.append(time.perf_counter() - t0)
    if engine == "zeroplus":
        r = engine_.memory_report()
        report = {"predicted": r.predicted_peak_bytes, "measured": r.process_peak_above_start_bytes,
                  "error": r.peak_error_pct,
                  # what the ledger held when its total peaked, by category (why a cell is where it is)
                  "ledger_at_peak": {c.value: n for c, n in engine_.ledger.at_peak.items()}}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"peak": rss_bytes("VmHWM") - start, "times": times, "losses": losses, **report}, f)
    dist.barrier()
    os._exit(0)


def launch(engine: str, cell: dict[str, str]) -> dict[str, Any]:
    """One launch of ``engine`` on ``cell`` (its axes' values; ``"scale": "test"`` for the suite's sizes): the
    peak (max over ranks), the median step, and zeroplus's figures, the worst rank's error with every rank's in
    ``errors``."""
    ranks = int(cell["ranks"])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in _NOT_INHERITED}
        env.update(TUNED_ENV if cell["allocs"] == "return" else {}, OMP_NUM_THREADS="1",
                   ZEROPLUS_ACCELERATOR="cpu")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               os.path.abspath(__file__), "--worker", engine, "--cell", json.dumps(cell), "--out", out]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from bench_worker import LaunchFailed, rank_results
        try:
            per_rank = rank_results(out, ranks, f"{engine} {cell}", proc)
        except LaunchFailed as failed:
            return {"failed": failed.first_error}
    result: dict[str, Any] = {"peak": max(r["peak"] for r in per_rank),
                              "step": statistics.median(per_rank[0]["times"][2:]), "loss": per_rank[0]["losses"][-1]}
    if engine == "zeroplus":
        worst = max(per_rank, key=lambda r: abs(r["error"]) if r["error"] is not None else -1)
        result.update(predicted=worst["predicted"], measured=worst["measured"], error=worst["error"],
                      errors=[r["error"] for r in per_rank],
                      ledger_at_peak=max(per_rank, key=lambda r: r["peak"]).get("ledger_at_peak"))  # (the peak's rank)
    return result


def fsdp_key(cell: dict[str, str]) -> str:
    """FSDP2's cell: the axes it has (no optimizer block, no overlap_comm)."""
    return json.dumps({k: v for k, v in cell.items() if k not in ("optimizers", "overlap")}, sort_keys=True)


def table(records: list[dict[str, Any]], note: str = "") -> str:
    """The matrix as Markdown: one row per zeroplus cell beside FSDP2's in the same cell and FSDP2's best (the lower
    of glibc as left and returning: its best honest configuration), then the worst cells."""
    fsdp = {r["key"]: r["result"] for r in records if r["engine"] == "fsdp2" and "peak" in r["result"]}
    lines = [f"ZeRO-3 zeroplus against FSDP2, {STEPS} steps per launch, peak resident MiB per rank above the process "
             f"before the model (max over ranks){note}",
             "| model | dtype | glibc | optimizer | overlap_comm | ranks | batch | zeroplus MiB | FSDP2 MiB, same "
             "glibc | FSDP2 best | x FSDP2 best | predicted MiB | engine-measured MiB | budget error | step s "
             "(zeroplus / FSDP2 same glibc) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, errors, over = [], [], []
    for r in records:
        if r["engine"] != "zeroplus":
            continue
        cell, z = r["cell"], r["result"]
        head = " | ".join(cell[a] for a in AXES)
        if "failed" in z:
            lines.append(f"| {head} | failed: {z['failed'][:160]} |")
            continue
        same = fsdp.get(fsdp_key(cell), {})
        both = [fsdp[k]["peak"] for k in (fsdp_key({**cell, "allocs": a}) for a in AXES["allocs"]) if k in fsdp]
        best = min(both) if both else None
        ratio = z["peak"] / best if best else None
        if ratio is not None:
            ratios.append((ratio, head))
            if ratio > TARGET_RATIO:
                over.append(f"- {head}: {ratio:.2f}x; {reason(z, best)}")
        if z.get("error") is not None:
            errors.append((abs(z["error"]), head))
        lines.append(f"| {head} | {_mib(z['peak'])} | {_mib(same.get('peak'))} | {_mib(best)}"
                     f"{'' if len(both) == 2 else ' (one glibc)'} | {f'{ratio:.2f}' if ratio else '-'} | ")
        lines[-1] += (f"{(z.get('predicted') or 0) / 2**20:.0f} | {z.get('measured', 0) / 2**20:.0f} | "
                      f"{z['error']:+.1f}% | " if z.get("error") is not None else "- | - | - | ")
        lines[-1] += f"{z['step']:.2f} / {same['step']:.2f} |" if "step" in same else f"{z['step']:.2f} / - |"
    if ratios:
        worst = max(ratios)
        lines.append(f"\nworst x FSDP2 best: {worst[0]:.2f} ({worst[1]}); target <= {TARGET_RATIO} in every cell: "
                     f"{sum(r <= TARGET_RATIO for r, _ in ratios)} of {len(ratios)} cells meet it")
        if over:
            lines += ["cells over the target, with what zeroplus's ledger held at its peak (the peak's rank):"] + over
    if errors:
        worst, median = max(errors), statistics.median(e for e, _ in errors)
        lines.append(f"worst budget error: {worst[0]:.1f}% ({worst[1]}); median {median:.1f}%"
                     f"; targets <= {TARGET_ERROR:g}% every cell ({sum(e <= TARGET_ERROR for e, _ in errors)} of "
                     f"{len(errors)}), median <= {TARGET_MEDIAN_ERROR:g}%")
    return "\n".join(lines)


# the ledger's categories of the weights, gradients and optimizer states: the weights as their shards, masters and
# gathered copies (at one rank in fp32 the resident weights are the master, counted as gathered)
MODEL_STATES = ("param", "param_gathered", "master", "optim_state", "grad")


def reason(result: dict[str, Any], best: int) -> str:
    """Why a zeroplus cell is over the target, from its ledger at the peak (``ledger_at_peak``): the model states'
    bytes (``MODEL_STATES``) by category and their ratio to FSDP2's best alone (over the target: no activation
    technique can bring the cell under it; fewer bytes a parameter would), the rest of the ledger, and what the
    process held beyond it (what autograd saves outside the ledger, the runtime)."""
    held = result.get("ledger_at_peak")
    if not held:
        return "no ledger recorded (measured before the ledger was kept)"
    states = {c: held.get(c, 0) for c in MODEL_STATES if held.get(c)}
    total_states, ledger = sum(states.values()), sum(held.values())
    floor = total_states / best
    parts = ", ".join(f"{c} {n / 2**20:.0f}" for c, n in states.items())
    rest = ", ".join(f"{c} {n / 2**20:.0f}" for c, n in sorted(held.items(), key=lambda kv: -kv[1])
                     if c not in MODEL_STATES and n)
    text = (f"model states {total_states / 2**20:.0f} MiB ({parts}), {floor:.2f}x FSDP2's best alone"
            + (f"; other ledger {rest} MiB" if rest else "")
            + f"; beyond the ledger {max(0, result['peak'] - ledger) / 2**20:.0f} MiB")
    if floor > TARGET_RATIO:
        text += (": the model states alone are over the target; fewer bytes a parameter would bring it under (bf16 "
                 "optimizer states take 4 off: zeroplus.optimizer_states)")
    return text


def _mib(value: int | None) -> str:
    return f"{value / 2**20:.0f}" if value else "-"


def read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for axis, values in AXES.items():
        p.add_argument(f"--{axis}", default=",".join(values))
    p.add_argument("--json", help="append each measured cell here; cells already in it are not run again")
    p.add_argument("--table", help="print the table of this file's cells and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, json.loads(args.cell), args.out)
        return
    if args.table:
        print(table(read(args.table)))
        return
    sys.path.insert(0, ROOT)
    from zeroplus.cpu_precision import native_bf16
    chosen = {axis: getattr(args, axis).split(",") for axis in AXES}
    for axis, values in chosen.items():
        unknown = set(values) - set(AXES[axis])
        if unknown:
            raise SystemExit(f"--{axis}: unknown {sorted(unknown)}; choose from {list(AXES[axis])}")
    note = ""
    if "bf16" in chosen["dtypes"] and not native_bf16():
        chosen["dtypes"].remove("bf16")
        note = "; bf16 skipped: this CPU emulates it"
    records = read(args.json) if args.json else []
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    done = {(r["engine"], r["key"]) for r in records}
    for values in itertools.product(*chosen.values()):
        cell = dict(zip(AXES, values))
        runs = [("fsdp2", {**cell, "allocs": a}) for a in AXES["allocs"]] + [("zeroplus", cell)]  # FSDP2's best too
        for engine, run_cell in runs:
            key = fsdp_key(run_cell) if engine == "fsdp2" else json.dumps(run_cell, sort_keys=True)
            if (engine, key) in done:
                continue
            record = {"engine": engine, "key": key, "cell": run_cell, "result": launch(engine, run_cell),
                      "date": time.strftime("%Y-%m-%d")}
            records.append(record)
            done.add((engine, key))
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(record) + "\n")
            print(f"{engine} {' '.join(run_cell[a] for a in AXES)}: " + (
                f"{record['result']['peak'] / 2**20:.0f} MiB" if "peak" in record["result"] else "failed"),
                flush=True)
    print(table(records, note))


if __name__ == "__main__":
    main()
