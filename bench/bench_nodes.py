"""Several nodes on one host: ZeRO-3's bytes per link, memory and step time for each hierarchical layout.

4 gloo ranks (torchrun, one thread each) read as 2 nodes of 2 (``zeroplus.node_size`` 2: ranks 0-1 and 2-3), the
built-in GPT in fp32, micro-batch x sequence and accumulation as given, AdamW. Rows, one launch each:

- zeroplus: flat ZeRO-3; MiCS (``mics_shard_size`` 2: shards within a node, replicas across); hpZ
  (``zero_hpz_partition_size`` 2); qwZ + qgZ (``zero_quantized_weights``, ``zero_quantized_gradients``); ZeRO++ (hpZ
  + qwZ + qgZ). ``transport`` native: the tensor collectives a GPU job runs.
- zeroplus ZeRO-3 2-level: one MiCS shard group of all 4 ranks (flat ZeRO-3's layout) with
  ``mics_hierarchical_params_gather``: the gathers across the nodes first, then within each.
- DeepSpeed 0.19.8 (CPU accelerator, torch's AdamW, ``stage3_param_persistence_threshold`` 0 so that every parameter
  is partitioned as zeroplus partitions this model; its defaults otherwise): ZeRO-3, hpZ 2, and ZeRO++ (hpZ + qwZ +
  qgZ), which does not run on a CPU (its int8 quantizer has no CPU kernel): the row says so.
- FSDP2: ``fully_shard`` per block and the model over 4 ranks; HSDP, the same over a 2 x 2 mesh (replicate across
  the nodes, shard within: MiCS's layout), its best honest configuration for the link between nodes.

Per row: the bytes a step crossing the link between nodes and staying within a node (every collective issued
through ``torch.distributed``, counted by its group's ranks: an all-gather's output, a reduce-scatter's or all-to-all's
input, an all-reduce's or broadcast's tensor), the process's resident peak above its start (rank 0; median of the
ranks in brackets), the median step time and the last loss; for zeroplus, the engine's estimate of rank 0's peak
above ``initialize`` (what its memory line predicts), the peak measured, and the worst rank's error. On one host both
links are shared memory, so the step times say what the mechanisms cost here, not what they save on a network.

    python bench/bench_nodes.py [--size small] [--seq 256] [--micro-batch 4] [--accumulation 2] [--steps 6]
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

NODE = 2
ROWS = {  # name: (framework, zero_optimization keys)
    "zeroplus ZeRO-3": ("zeroplus", {}),
    "zeroplus MiCS 2": ("zeroplus", {"mics_shard_size": NODE}),
    "zeroplus hpZ 2": ("zeroplus", {"zero_hpz_partition_size": NODE}),
    "zeroplus qwZ + qgZ": ("zeroplus", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "zeroplus ZeRO++": ("zeroplus", {"zero_hpz_partition_size": NODE, "zero_quantized_weights": True,
                                     "zero_quantized_gradients": True}),
    "zeroplus ZeRO-3 2-level": ("zeroplus", {"mics_shard_size": 4, "mics_hierarchical_params_gather": True}),
    "DeepSpeed ZeRO-3": ("deepspeed", {}),
    "DeepSpeed hpZ 2": ("deepspeed", {"zero_hpz_partition_size": NODE}),
    "DeepSpeed ZeRO++": ("deepspeed", {"zero_hpz_partition_size": NODE, "zero_quantized_weights": True,
                                       "zero_quantized_gradients": True}),
    "FSDP2": ("fsdp2", {}),
    "FSDP2 HSDP 2 x 2": ("hsdp", {}),
}
# (all_gather_into_tensor and reduce_scatter_tensor call the *_single functions by their module names: counted there)
_MESSAGE = {"all_gather_single": "output_tensor", "reduce_scatter_single": "input", "all_reduce": "tensor",
            "all_to_all_single": "input", "broadcast": "tensor", "reduce": "tensor"}


class LinkVolume:
    """Bytes of every collective issued through ``torch.distributed``'s functions, by link: ``inter_node`` where
    the group's ranks span nodes of ``NODE`` consecutive ranks, else ``intra_node`` (installed before any framework
    binds them)."""

    def __init__(self) -> None:
        self.bytes = {"intra_node": 0, "inter_node": 0}
        from torch.distributed import distributed_c10d
        for name, argument in _MESSAGE.items():
            counted = self._wrap(getattr(distributed_c10d, name), argument)
            setattr(distributed_c10d, name, counted)
            setattr(dist, name, counted)

    def _wrap(self, fn, argument):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            link = "intra_node" if len({r // NODE for r in ranks}) == 1 else "inter_node"
            message = bound[argument]
            self.bytes[link] += message.numel() * message.element_size()
            return fn(*args, **kwargs)
        return counted

    def take(self) -> dict[str, int]:
        out, self.bytes = self.bytes, {"intra_node": 0, "inter_node": 0}
        return out


def _worker(args: argparse.Namespace) -> None:
    from bench_worker import rss_bytes
    volume = LinkVolume()
    start = rss_bytes("VmRSS")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    framework, keys = ROWS[args.worker]
    from zeroplus.models import GPT, gpt_config
    torch.manual_seed(0)
    model = GPT(gpt_config(args.size, block_size=args.seq))
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.accumulation,
           "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, **keys},
           "zeroplus": {"log_level": "warning", "memory_estimate": True, "transport": "native", "node_size": NODE,
                        "seq_len": args.seq}}
    if framework in ("zeroplus", "deepspeed"):
        if framework == "zeroplus":
            import zeroplus
            engine = zeroplus.initialize(model, cfg)
        else:  # (its CPU build: torch's AdamW; its defaults otherwise, as a DeepSpeed user runs it)
            import deepspeed
            cfg.pop("zeroplus")
            cfg["optimizer"]["params"]["torch_adam"] = True
            # every parameter partitioned, as zeroplus partitions this model (DeepSpeed's default of 1e5 elements a
            # parameter would keep all of GPT small's gathered: ZeRO-2's bytes, at its memory)
            cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=list(model.parameters()))

        def micro(x: torch.Tensor, last: bool) -> torch.Tensor:
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
            return loss
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, NODE) if framework == "hsdp" else (4,),
                                mesh_dim_names=("replicate", "shard") if framework == "hsdp" else ("shard",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

        def micro(x: torch.Tensor, last: bool) -> torch.Tensor:
            model.set_requires_gradient_sync(last)
            loss = model(x, x)
            (loss / args.accumulation).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            return loss
    g = torch.Generator().manual_seed(rank)
    times, volumes, loss = [], [], torch.zeros(())
    volume.take()  # (set-up's broadcasts)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        for k in range(args.accumulation):
            x = torch.randint(0, 256, (args.micro_batch, args.seq), generator=g)
            loss = micro(x, k == args.accumulation - 1)
        times.append(time.perf_counter() - t0)
        volumes.append(volume.take())
    predicted = None  # zeroplus: the estimate's peak above initialize against the one measured, as its log says
    if framework == "zeroplus":
        report = engine.memory_report()
        predicted = (report.predicted_peak_bytes, report.process_peak_above_start_bytes)
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump({"peak": rss_bytes("VmHWM") - start, "times": times, "volumes": volumes, "loss": loss.item(),
                   "predicted": predicted}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


OPTIONS = {"size": "small", "seq": 256, "micro_batch": 4, "accumulation": 2, "steps": 6}  # (the docstring's)


def _launch(row: str, args: argparse.Namespace) -> list[dict]:
    from bench_worker import torchrun
    forwarded = [item for key in OPTIONS for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
    return torchrun(__file__, ["--worker", row, *forwarded], 4, row)


def _prediction(ranks: list[dict]) -> str:
    """zeroplus's estimate of rank 0's peak above initialize, the peak measured, and the worst rank's error."""
    if ranks[0]["predicted"] is None or ranks[0]["predicted"][0] is None:
        return ""
    predicted, measured = ranks[0]["predicted"]
    worst = max((abs(p - m) / m, (p - m) / m) for p, m in (r["predicted"] for r in ranks))[1]
    return f"{predicted / 2**20:>15.1f}{measured / 2**20:>10.1f}{100 * worst:>+7.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default in OPTIONS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
    for launched in ("--worker", "--out"):  # (set by _launch for the ranks)
        p.add_argument(launched, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    print(f"4 ranks as 2 nodes of 2, GPT-{args.size}, micro-batch {args.micro_batch} x {args.seq}, accumulation "
          f"{args.accumulation}, fp32, ZeRO-3 / FSDP2; a step's bytes per link (rank 0), peak RSS above start, median "
          f"of the last {args.steps - 2} of {args.steps} steps")
    print(f"  {'row':<22}{'across MB':>11}{'within MB':>11}{'peak MiB (median)':>20}{'step s':>9}{'loss':>8}"
          f"{'predicted MiB':>15}{'measured':>10}{'error':>8}")
    from bench_worker import LaunchFailed
    for row in args.rows.split(","):
        try:
            ranks = _launch(row, args)
        except LaunchFailed as failed:
            print(f"  {row:<22}did not run: {failed.first_error[-150:]}")
            continue
        first = ranks[0]
        last = first["volumes"][-1]
        peaks = sorted(r["peak"] for r in ranks)
        step = statistics.median(first["times"][2:] or first["times"])
        print(f"  {row:<22}{last['inter_node'] / 2**20:>11.2f}{last['intra_node'] / 2**20:>11.2f}"
              f"{first['peak'] / 2**20:>10.0f} ({statistics.median(peaks) / 2**20:>5.0f})"
              f"{step:>11.3f}{first['loss']:>8.3f}" + _prediction(ranks))


if __name__ == "__main__":
    main()
