"""Benchmark: optimizer-state offload (``zero_optimization.offload_optimizer``), GPT-111M, 2 ranks, CPU.

Rows, each two fresh torchrun launches of ``bench_worker.py`` (memory with glibc told to return
freed memory, time without), at ZeRO stage 3 (``--stage``):

- zeroplus without offload; with the states in files (``device: nvme``) at ratio 1 and 0.5; at
  ratio 1 through the page cache (``zeroplus.direct_io: false``; the default is O_DIRECT); at
  ratio 1 with shared-storage master weights; with the parameter shards in files as well
  (``offload_param``), with and without shared storage;
- ``cpu`` and ``deepspeed-cpu``: ``offload_optimizer: {"device": "cpu"}``. DeepSpeed then steps with its own
  ``DeepSpeedCPUAdam`` (the rows drop ``torch_adam``); on a CPU-only machine zeroplus's host tier is the
  device, so its row is its plain host step: the comparison is the two host optimizer steps in training;
- DeepSpeed without offload, and with the same ``offload_optimizer`` JSON at ratio 1 (its
  ``ratio`` applies to CPU offload only, so an nvme row at 0.5 would repeat this one), and with
  ``offload_param`` too.

On a CPU-only machine the host is the device, so ``device: cpu`` saves nothing and only the
file tier is measured. Every offload row uses the same ``sub_group_size`` (``--sub-group-size``,
default 1e7): DeepSpeed's default of 1e9 makes one sub-group of the whole shard, whose window is
then every state. DeepSpeed's NVMe swapper needs its async-io op (``apt-get install -y
libaio-dev``; built on first use, a few minutes); ``--rows`` without the deepspeed rows skips it.

    python bench/bench_offload.py                        # about 25 minutes on 2 cores
    python bench/bench_offload.py --rows none,nvme,nvme-half
    python bench/bench_offload.py --rows none,cpu,deepspeed,deepspeed-cpu --versus deepspeed-cpu --dtype fp32
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import measure, print_ratio_table, row_parser  # noqa: E402

ROWS = {  # name: (framework, offload_optimizer ratio or None, offload_param too, zeroplus block)
    "none": ("zeroplus", None, False, {}),
    "cpu": ("zeroplus", 1.0, False, {}),
    "nvme": ("zeroplus", 1.0, False, {}),
    "nvme-half": ("zeroplus", 0.5, False, {}),
    "nvme-buffered": ("zeroplus", 1.0, False, {"direct_io": False}),
    "nvme+shared": ("zeroplus", 1.0, False, {"shared_master_weights": True}),
    "nvme+param": ("zeroplus", 1.0, True, {}),
    "nvme+param+shared": ("zeroplus", 1.0, True, {"shared_master_weights": True}),
    "deepspeed": ("deepspeed", None, False, {}),
    "deepspeed-cpu": ("deepspeed", 1.0, False, {}),
    "deepspeed-nvme": ("deepspeed", 1.0, False, {}),
    "deepspeed-nvme+param": ("deepspeed", 1.0, True, {}),
}


def offload_json(ratio: float | None, param: bool, path: str, sub_group_size: int, buffer_count: int,
                 device: str = "nvme") -> dict:
    out: dict = {}
    if ratio is not None and device == "cpu":
        out.update(sub_group_size=sub_group_size, offload_optimizer={"device": "cpu"})
    elif ratio is not None:
        out.update(sub_group_size=sub_group_size, offload_optimizer={"device": "nvme", "nvme_path": path,
                                                                     "ratio": ratio, "buffer_count": buffer_count})
    if param:
        out["offload_param"] = {"device": "nvme", "nvme_path": path}
    return out


def main() -> None:
    p = row_parser(__doc__, ROWS)
    p.add_argument("--sub-group-size", type=int, default=10_000_000)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--versus", default="deepspeed-nvme", help="the DeepSpeed row each ratio is taken against")
    p.add_argument("--nvme-path", default=None, help="directory for the offloaded states (default: a temporary one)")
    args = p.parse_args()
    nvme_path = args.nvme_path or tempfile.mkdtemp(prefix="zeroplus-bench-nvme-")
    rows = []
    for name in args.rows.split(","):
        framework, ratio, param, zp = ROWS[name]
        device = "cpu" if name.endswith("cpu") else "nvme"
        zero = offload_json(ratio, param, nvme_path, args.sub_group_size, args.buffer_count, device)
        extra = ["--zeroplus", json.dumps(zp), "--zero", json.dumps(zero)]
        rows.append(measure(name, framework, args.stage, args, extra))
    print(f"GPT {args.model} ({rows[0]['params'] / 1e6:.0f}M parameters), {args.dtype}, ZeRO stage {args.stage}, "
          f"2 ranks (gloo, CPU), micro-batch {args.micro_batch}, sequence {args.seq}, {args.steps} steps "
          f"(median of the last "
          f"{args.steps - args.warmup}); offload rows: nvme, sub_group_size {args.sub_group_size}, buffer_count "
          f"{args.buffer_count}; peak = per-rank resident peak above start, max over ranks")
    print_ratio_table(rows, "none", args.versus)
    print("\nzeroplus's ledger on rank 0 (MiB, live at the end / peak): optimizer states resident on the device, "
          "offload windows in flight, fp32 masters")
    for r in rows:
        if r["ledger"]:
            cell = lambda c: "{:.0f} / {:.0f}".format(*(b / 2**20 for b in r["ledger"][c]))  # noqa: E731
            print(f"{r['row']:<24}optim_state {cell('optim_state'):>12}   offload_buffer {cell('offload_buffer'):>12}"
                  f"   master {cell('master'):>12}")


if __name__ == "__main__":
    main()
