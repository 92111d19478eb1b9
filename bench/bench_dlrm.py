"""Benchmark: a DLRM of Criteo's shape on 2 gloo ranks, zeroplus's sharded tables (table-, row-, column-wise and
the planner's choice) against plain ZeRO-3 of the same model (its tables ``nn.EmbeddingBag`` parameters) and
TorchRec's ``DistributedModelParallel`` (table-, row- and column-wise).

The model: ``models.dlrm.criteo_config`` (13 dense features, 26 tables of Criteo's Kaggle cardinalities, each
at most ``--max-rows`` rows, dimension 16, MLPs 512-256-16 and 512-256-1), synthetic batches (power-law ids,
teacher labels) of ``--batch`` samples per rank, each rank its own. Optimizers: the MLPs AdamW (lr 1e-3); the
tables row-wise Adagrad (lr 0.05) for zeroplus's collection and TorchRec's fused kernel
(``EXACT_ROWWISE_ADAGRAD``); plain ZeRO-3 steps everything with AdamW (what a DeepSpeed JSON gives a model
whose tables are parameters: a dense table-sized gradient and two table-sized moments).

Each peer in its best honest configuration: zeroplus's MLPs under ZeRO-2 (they are 0.46M parameters: ZeRO-3
would only add gathers), fp32; TorchRec's MLPs under DDP (DMP's default), its tables in FBGEMM's fused CPU
kernels with the optimizer fused into backward. TorchRec re-initialises tables when it shards them, so every
run copies the same initial weights in (TorchRec: into each rank's local shards), and the losses of
matching rows are compared (``max |dloss|`` against zeroplus's row of the same sharding). ``zeroplus-cached``:
the planner's sharding with every table of more than ``--cache-rows`` rows in files (``row_cache.py``), that
many hot rows in memory; its losses against ``zeroplus-auto``'s, its hit rate over all cached tables.

For each row two fresh launches: memory with glibc returning freed memory (``MALLOC_MMAP_THRESHOLD_=131072
MALLOC_TRIM_THRESHOLD_=131072``; per-rank peak resident memory above the process before the model, max over
ranks), time without it (median step after ``--warmup``; samples/s = ranks x batch / median).

    python bench/bench_dlrm.py                       # every row (about 5 minutes here)
    python bench/bench_dlrm.py --rows zeroplus-table,torchrec-table --max-rows 0   # Criteo's full 33.8M rows

TorchRec 1.8 offers table- and column-wise sharding on CPU (row-wise only on CUDA: its planner refuses it
here), so ``torchrec-row`` is not among the default rows.

TorchRec on CPU (torch 2.13): ``pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0`` then
``pip install tensordict torchmetrics pyre-extensions`` (1.9.x does not load against torch 2.13); its rows
are skipped, with the reason, where it is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
ROWS = ["zeroplus-table", "zeroplus-row", "zeroplus-column", "zeroplus-auto", "zeroplus-cached", "zeroplus-zero3",
        "torchrec-table",
        "torchrec-column"]  # (torchrec-row: TorchRec 1.8 shards row-wise on CUDA only; it refuses on CPU)
DENSE_LR, TABLE_LR = 1e-3, 0.05


# --- the worker: one rank of one row ---------------------------------------------------------------------------
def initial_slice(index: int, rows: tuple[int, int], cols: tuple[int, int], dim: int, num_rows: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of table ``index``'s initial weights: a hash of each element's
    position (uniform in +-1/sqrt(rows)), so a rank makes its shard alone and every row starts alike."""
    r = torch.arange(*rows, dtype=torch.float64).unsqueeze(1)
    c = torch.arange(*cols, dtype=torch.float64).unsqueeze(0)
    u = torch.frac(torch.sin((r * dim + c) * 12.9898 + index * 78.233) * 43758.5453).abs()
    return ((u * 2 - 1) * num_rows ** -0.5).float()


def initial_table(cfg, index: int) -> torch.Tensor:
    t = cfg.tables[index]
    return initial_slice(index, (0, t.num_embeddings), (0, t.dim), t.dim, t.num_embeddings)


def dense_layers(cfg) -> tuple[nn.Module, nn.Module]:
    """The bottom and top MLPs every row starts from (as ``DLRM`` builds them after ``torch.manual_seed(0)``)."""
    from zeroplus.models.dlrm import mlp
    torch.manual_seed(0)
    n = len(cfg.tables) + 1
    return mlp([cfg.dense_features, *cfg.bottom], True), mlp([cfg.bottom[-1] + n * (n - 1) // 2, *cfg.top, 1], False)


def _zeroplus(kind: str, cfg, batch: int, cache_rows: int, tier_path: str):
    import dataclasses

    import zeroplus
    from zeroplus.embeddings import SparseOptimConfig
    from zeroplus.embeddings.tables import TableTier
    from zeroplus.models.dlrm import DLRM, criteo_config
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_clipping": 0.0, "zeroplus": {"log_level": "warning"},
              "optimizer": {"type": "AdamW", "params": {"lr": DENSE_LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3 if kind == "zero3" else 2}}
    tier = None
    if kind == "zero3":
        model: nn.Module = _PlainDLRM(cfg)
    else:
        if kind == "cached":  # the planner's sharding, tables of more rows than cache_rows in files
            kind, tier = "auto", TableTier("file", tier_path)
            cfg = criteo_config(16, max(t.num_embeddings for t in cfg.tables), cache_rows=cache_rows)
        cfg = dataclasses.replace(cfg, tables=[dataclasses.replace(t, sharding=kind) for t in cfg.tables])
        model = DLRM(cfg, SparseOptimConfig("rowwise_adagrad", lr=TABLE_LR), tier=tier)
        model.bottom, model.top = dense_layers(cfg)
        ebc = model.embeddings
        for i, t in enumerate(ebc.tables):  # this rank's shard only (a cached table's: through its tier)
            s = ebc.mine(t.name)
            weight, states = ebc.shard_values(t.name)
            weight.copy_(initial_slice(i, (s.row0, s.row1), (s.col0, s.col1), t.dim, t.num_embeddings))
            ebc.replace_shard(t.name, weight, states)
    engine = zeroplus.initialize(model, config)

    def step(dense, sparse, labels) -> float:
        loss = engine(dense, sparse, labels)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, model


class _PlainDLRM(nn.Module):
    """The same DLRM with its tables as ``nn.EmbeddingBag`` parameters (plain ZeRO-3 partitions them)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.bottom, self.top = dense_layers(cfg)
        self.names = [t.name for t in cfg.tables]
        self.bags = nn.ModuleDict({t.name: nn.EmbeddingBag.from_pretrained(initial_table(cfg, i), freeze=False,
                                                                           mode="sum")
                                   for i, t in enumerate(cfg.tables)})
        n = len(cfg.tables) + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pairs", rows * n + cols, persistent=False)

    def forward(self, dense, sparse, labels):
        x = self.bottom(dense)
        pooled = torch.cat([self.bags[n](*sparse[n]) for n in self.names], 1)
        features = torch.cat([x, pooled], 1).view(x.shape[0], -1, x.shape[1])
        products = torch.bmm(features, features.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        logit = self.top(torch.cat([x, products], 1)).squeeze(1)
        return F.binary_cross_entropy_with_logits(logit, labels)


def _torchrec(kind: str, cfg, world: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM as TorchRecDLRM
    bottom, top = dense_layers(cfg)
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim,
                                                            num_embeddings=t.num_embeddings, feature_names=[t.name])
                                         for t in cfg.tables], device=torch.device("meta"))
    model = TorchRecDLRM(embedding_bag_collection=ebc, dense_in_features=cfg.dense_features,
                         dense_arch_layer_sizes=list(cfg.bottom), over_arch_layer_sizes=[*cfg.top, 1])
    linears = [m for m in (*bottom, *top) if isinstance(m, nn.Linear)]
    theirs = [m for arch in (model.dense_arch, model.over_arch) for m in arch.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for a, b in zip(linears, theirs, strict=True):
            b.weight.copy_(a.weight)
            b.bias.copy_(a.bias)
    sharding = {"table": ShardingType.TABLE_WISE, "row": ShardingType.ROW_WISE, "column": ShardingType.COLUMN_WISE}
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding[kind].value]) for t in cfg.tables}
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                          "learning_rate": TABLE_LR, "eps": 1e-10})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    index = {t.name: i for i, t in enumerate(cfg.tables)}
    with torch.no_grad():  # TorchRec initialised its shards itself: the shared initial values copied in
        for key, value in dmp.state_dict().items():
            name = key.split(".")[-2]
            if name in index and hasattr(value, "local_shards"):
                t = cfg.tables[index[name]]
                for s in value.local_shards():
                    (r0, c0), (nr, nc) = s.metadata.shard_offsets, s.metadata.shard_sizes
                    s.tensor.copy_(initial_slice(index[name], (r0, r0 + nr), (c0, c0 + nc), t.dim, t.num_embeddings))
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    adamw = torch.optim.AdamW(dense, lr=DENSE_LR, weight_decay=0.0)
    names = [t.name for t in cfg.tables]

    def step(dense_x, sparse, labels) -> float:
        lengths = torch.cat([torch.diff(sparse[n][1], append=torch.tensor([sparse[n][0].numel()])) for n in names])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.cat([sparse[n][0] for n in names]),
                                                  lengths=lengths)
        logit = dmp(dense_x, kjt).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logit, labels)
        loss.backward()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        return loss.item()
    return step, dmp


def worker(args: argparse.Namespace) -> None:
    from bench_worker import rss_bytes, start_measuring

    from zeroplus.models.dlrm import criteo_config, synthetic_batch
    rank, start = start_measuring()
    world = dist.get_world_size()
    cfg = criteo_config(16, args.max_rows or None)
    framework, kind = args.row.split("-")
    step, model = (_zeroplus(kind, cfg, args.batch, args.cache_rows, args.tier_path) if framework == "zeroplus"
                   else _torchrec(kind, cfg, world))
    losses, seconds = [], []
    for i in range(args.steps):
        batch = synthetic_batch(cfg, args.batch, torch.Generator().manual_seed(1000 * i + rank))
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step(*batch))
        seconds.append(time.perf_counter() - t0)
    caches = getattr(getattr(model, "embeddings", None), "caches", {})
    hits = sum(c.hits for c in caches.values()) / max(1, sum(c.fetched for c in caches.values())) if caches else None
    result = {"rank": rank, "peak_above_start_bytes": rss_bytes("VmHWM") - start, "losses": losses,
              "step_seconds": seconds, "hit_rate": hits}
    with open(f"{args.out_prefix}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# --- the driver ------------------------------------------------------------------------------------------------
def launch(row: str, args: argparse.Namespace, malloc: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "result")
        env = dict(os.environ, OMP_NUM_THREADS="1", ZEROPLUS_ACCELERATOR="cpu",
                   PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        for key in MALLOC_ENV:
            env.pop(key, None)
        if malloc:
            env.update(MALLOC_ENV)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               os.path.abspath(__file__), "--worker", "--row", row, "--max-rows", str(args.max_rows), "--batch",
               str(args.batch), "--steps", str(args.steps), "--out-prefix", prefix, "--cache-rows",
               str(args.cache_rows), "--tier-path", os.path.join(tmp, "tables")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in proc.stderr.splitlines() if "Error:" in line]
            raise RuntimeError(f"{row} failed:\n{proc.stderr[-4000:]}\n{errors[0] if errors else ''}")
        return [json.load(open(f"{prefix}.{r}.json")) for r in range(args.nproc)]


def torchrec_problem() -> str | None:
    try:
        import torchrec  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to load is a reason to skip its rows
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(ROWS), help=f"any of {', '.join(ROWS)}")
    p.add_argument("--max-rows", type=int, default=1_000_000, help="rows per table at most (0: Criteo's 33.8M)")
    p.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cache-rows", type=int, default=100_000,
                   help="zeroplus-cached: tables of more rows live in files, this many hot rows in memory")
    p.add_argument("--tier-path", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--out-prefix", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from zeroplus.models.dlrm import criteo_config
    cfg = criteo_config(16, args.max_rows or None)
    rows_total = sum(t.num_embeddings for t in cfg.tables)
    skip = torchrec_problem()
    results = []
    for row in args.rows.split(","):
        if row.startswith("torchrec") and skip:
            print(f"  skipped {row}: TorchRec does not load ({skip})", file=sys.stderr)
            continue
        try:
            mem, timed = launch(row, args, malloc=True), launch(row, args, malloc=False)
        except RuntimeError as err:
            print(f"  failed: {row}: {str(err).strip().splitlines()[-1][:300]}", file=sys.stderr, flush=True)
            continue
        step = statistics.median(t for r in timed for t in r["step_seconds"][args.warmup:])
        results.append({"row": row, "peak_mib": max(r["peak_above_start_bytes"] for r in mem) / 2**20,
                        "step_s": step, "samples_s": args.nproc * args.batch / step, "losses": timed[0]["losses"],
                        "hit_rate": timed[0]["hit_rate"]})
        print(f"  done: {row}: {results[-1]['peak_mib']:.0f} MiB, {step * 1e3:.1f} ms/step", file=sys.stderr,
              flush=True)
    table_mib = rows_total * 16 * 4 / 2**20
    print(f"DLRM, Criteo's 26 tables at most {args.max_rows or 'all'} rows ({rows_total / 1e6:.2f}M rows x 16, "
          f"{table_mib:.0f} MiB of fp32 tables), {args.nproc} gloo ranks, batch {args.batch} per rank, "
          f"{args.steps} steps (median of the last {args.steps - args.warmup})")
    columns = [("row", 18), ("peak MiB/rank", 15), ("step ms", 10), ("samples/s", 11), ("last loss", 11),
               ("max |dloss|", 13), ("cache hits", 12)]
    header = "".join(f"{name:<{width}}" if i == 0 else f"{name:>{width}}" for i, (name, width) in enumerate(columns))
    print(f"{header}\n{'-' * len(header)}")
    by_row = {r["row"]: r for r in results}
    for r in results:
        twin = by_row.get("zeroplus-" + r["row"].split("-")[1]) if r["row"].startswith("torchrec") else (
            by_row.get("zeroplus-auto") if r["row"] == "zeroplus-cached" else None)
        diff = f"{max(abs(a - b) for a, b in zip(r['losses'], twin['losses'])):.2e}" if twin else "-"
        hits = f"{100 * r['hit_rate']:.1f}%" if r["hit_rate"] is not None else "-"
        print(f"{r['row']:<18}{r['peak_mib']:>15.0f}{r['step_s'] * 1e3:>10.1f}{r['samples_s']:>11,.0f}"
              f"{r['losses'][-1]:>11.4f}{diff:>13}{hits:>12}")


if __name__ == "__main__":
    main()
