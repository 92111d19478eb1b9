"""Benchmark: optimizer states stored in bf16 or fp8 (``zeroplus.optimizer_states``) against fp32, and DeepSpeed's
``bf16_optimizer_states``, GPT 111M bf16 on 2 ranks.

Per row and ZeRO stage: the ledger's ``optim_state`` peak on rank 0 in bytes per parameter of the model (what a
rank holds of Adam's two moments, over the world: 8 / world in fp32), the same against the formula (the
moments' bytes per element times the elements a rank owns, ``P / world`` to within padding), the rank's whole
ledger (model states, gradients, buffers) and its step time against the fp32 row. DeepSpeed runs the same JSON
with ``bf16: {"bf16_optimizer_states": true, "bf16_master_weights_and_grads": true}`` (it needs both), memory only;
the ``ds-keys`` row runs zeroplus under that same block (bf16 moments and bf16 master weights).

    python bench/bench_state_dtypes.py                          # stages 1 and 3 (about 12 minutes)
    python bench/bench_state_dtypes.py --stages 1,2,3 --rows fp32,bf16
    python bench/bench_state_dtypes.py --optimizer-only         # the optimizer's step alone, one thread

``--optimizer-only``: one process, one thread, the step of one flat shard of ``--elements`` (55.4M: GPT 111M over 2
ranks) with fp32 gradients: torch's fused AdamW over fp32 moments, against the stored-states AdamW over bf16 moments
with the one-pass CPU loop (``kernels/native_adam.py``) and with the chunked step it replaces, and the same for fp8
and mxfp8 moments (stochastic, their default); median of 7 steps.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import measure, row_parser  # noqa: E402

ROWS = {  # name: (framework, zeroplus block, bf16 block, bytes per element of the two moments)
    "fp32": ("zeroplus", {}, {}, 8),
    "bf16": ("zeroplus", {"optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "bf16"}}, {}, 4),
    "bf16-stochastic": ("zeroplus", {"optimizer_states": {"exp_avg": "bf16", "exp_avg_sq": "bf16",
                                                          "rounding": "stochastic"}}, {}, 4),
    "bf16-first": ("zeroplus", {"optimizer_states": {"exp_avg": "bf16"}}, {}, 6),
    # fp8 (e4m3) with a power-of-two scale per 128 elements (4 bytes a block), stochastic: the default for fp8
    "fp8": ("zeroplus", {"optimizer_states": {"exp_avg": "fp8", "exp_avg_sq": "fp8"}}, {}, 2 * (1 + 4 / 128)),
    # mxfp8: e4m3 with an e8m0 scale per 32 elements (1 byte a block), stochastic
    "mxfp8": ("zeroplus", {"optimizer_states": {"exp_avg": "mxfp8", "exp_avg_sq": "mxfp8"}}, {}, 2 * (1 + 1 / 32)),
    "deepspeed": ("deepspeed", {}, {}, 8),
    "deepspeed-bf16": ("deepspeed", {}, {"bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}, 4),
    # zeroplus under DeepSpeed's own keys: bf16 moments and bf16 masters (rounded stochastically, the default)
    "ds-keys": ("zeroplus", {}, {"bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}, 4),
}
WORLD = 2


def main() -> None:
    p = row_parser(__doc__, ROWS)
    p.set_defaults(rows="fp32,bf16,bf16-stochastic,fp8,deepspeed,deepspeed-bf16")
    p.add_argument("--stages", default="1,3")
    p.add_argument("--json", help="also write the measured rows here")
    p.add_argument("--table", help="print the table of rows a --json file holds, and exit")
    p.add_argument("--optimizer-only", action="store_true", help="time the optimizer's step alone, and exit")
    p.add_argument("--elements", type=int, default=55_400_000)
    args = p.parse_args()
    if args.optimizer_only:
        optimizer_only(args.elements)
        return
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print_table(saved["rows"], saved["args"])
        return
    table = []
    for stage in [int(s) for s in args.stages.split(",")]:
        for name in args.rows.split(","):
            framework, zp, bf16, per_element = ROWS[name]
            args.memory_only = framework == "deepspeed"
            extra = ["--zeroplus", json.dumps({**zp, "log_level": "warning"}), "--bf16", json.dumps(bf16)]
            try:
                row = measure(name, framework, stage, args, extra)
            except RuntimeError as err:
                print(f"  {name} stage {stage} did not run: {str(err).splitlines()[-1][:200]}", file=sys.stderr)
                continue
            table.append(dict(row, stage=stage, per_element=per_element))
    shape = {k: getattr(args, k) for k in ("model", "dtype", "micro_batch", "seq", "steps", "warmup")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": table, "args": shape}, f)
    print_table(table, shape)


def print_table(table: list[dict], args: dict) -> None:
    """Each row as bytes per parameter of the moments against the formula, the ledger and the step."""
    print(f"GPT {args['model']}, {args['dtype']}, {WORLD} ranks (gloo, CPU), micro-batch {args['micro_batch']} x "
          f"{args['seq']}, "
          f"{args['steps']} steps (step: median after {args['warmup']}); optim_state: rank 0's peak; ledger: rank 0's "
          f"categories at its peak")
    print(f"{'stage':>5} {'row':<16}{'optim B/param':>14}{'formula':>9}{'x formula':>10}{'ledger MiB':>11}"
          f"{'peak GiB':>9}{'step s':>8}{'x fp32':>7}{'loss':>8}")
    for r in table:
        base = next((b for b in table if b["stage"] == r["stage"] and b["row"] == "fp32"), None)
        states = r["ledger"].get("optim_state", [0, 0, 0])[1]  # (live, peak, at the ledger's peak)
        per_param = states / r["params"]
        formula = r["per_element"] / WORLD
        step_ratio = f"{r['step_s'] / base['step_s']:.3f}" if base and r["framework"] == "zeroplus" else "-"
        ledger = sum(v[2] for k, v in r["ledger"].items() if not k.endswith("_offloaded")) / 2**20
        shown = (f"{per_param:>14.3f}{formula:>9.2f}{per_param / formula:>10.3f}{ledger:>11.0f}"
                 if r["framework"] == "zeroplus" else f"{'-':>14}{formula:>9.2f}{'-':>10}{'-':>11}")
        step = f"{r['step_s']:>8.2f}" if r["framework"] == "zeroplus" else f"{'-':>8}"
        print(f"{r['stage']:>5} {r['row']:<16}{shown}{r['peak_gib']:>9.3f}{step}{step_ratio:>7}{r['loss']:>8.4f}")


def optimizer_only(elements: int) -> None:
    import torch

    from zeroplus.kernels.block_fp8 import E4M3, E8M0, MX_BLOCK
    from zeroplus.optim.stored_states import StoredStatesAdamW
    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.randn(elements))
    param.grad = torch.randn(elements) * 1e-3
    kinds = {"bf16": {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
             "fp16": {"exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16},
             "fp8": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": E4M3},
             "mxfp8": {"exp_avg_dtype": E4M3, "exp_avg_sq_dtype": E4M3, "block": MX_BLOCK, "scale_dtype": E8M0}}
    rows = [("fp32 moments, torch's fused AdamW", lambda: torch.optim.AdamW([param], lr=1e-4, fused=True), None)]
    for kind, roundings in (("bf16", ("nearest", "stochastic")), ("fp16", ("nearest",)), ("fp8", ("stochastic",)),
                            ("mxfp8", ("stochastic",))):
        for rounding in roundings:
            for native in (True, False):
                rows.append((f"{kind} moments, {rounding}, {'one-pass loop' if native else 'chunked step'}",
                             lambda r=rounding, k=kind: StoredStatesAdamW([param], lr=1e-4, fused=True, rounding=r,
                                                                          **kinds[k]),
                             native))
    print(f"the optimizer's step over {elements / 1e6:.1f}M elements, one thread (median of 7, after one)")
    base = None
    for name, make, native in rows:
        opt = make()
        if native is not None and not native:
            opt.native = None
        elif native and opt.native is None:
            print(f"{name}: the loop is unavailable here")
            continue
        opt.step()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        median = sorted(times)[3] * 1e3
        base = base or median
        print(f"{name:<46}{median:8.1f} ms{median / base:7.2f}x")
        del opt


if __name__ == "__main__":
    main()
