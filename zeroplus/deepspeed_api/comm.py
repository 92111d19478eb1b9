"""``deepspeed.comm``: DeepSpeed's communication module, as torch.distributed under zeroplus.

``init_distributed`` creates the process group the way ``zeroplus.initialize`` does (the
accelerator's backend, zeroplus's collective timeout) from the launcher's environment; with no
launcher, a group of one rank (DeepSpeed would look for MPI). The collectives are
``torch.distributed``'s, with DeepSpeed's profiling keywords (``prof``, ``log_name``, ``debug``)
accepted and ignored.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist
from torch.distributed import ReduceOp

from zeroplus import comms_log
from zeroplus.accelerator import get_accelerator
from zeroplus.collective_faults import set_timeout_seconds
from zeroplus.comm import DEFAULT_TIMEOUT_SECONDS, init_distributed_if_launched

from .unsupported import module_getattr

__getattr__ = module_getattr("deepspeed.comm")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True, timeout: Any = None,
                     init_method: str | None = None, dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    if dist.is_initialized():
        return
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else DEFAULT_TIMEOUT_SECONDS
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and dist_backend is None and init_method is None:
        init_distributed_if_launched(seconds)
        return
    env_rank = int(os.environ.get("RANK", rank if rank >= 0 else 0))
    env_world = int(os.environ.get("WORLD_SIZE", world_size if world_size > 0 else 1))
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    dist.init_process_group(backend=dist_backend or get_accelerator().comm_backend, init_method=init_method,
                            rank=env_rank, world_size=env_world, timeout=datetime.timedelta(seconds=seconds))
    set_timeout_seconds(seconds)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> Any:
    return dist.group.WORLD


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **kwargs: Any) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def broadcast(tensor: Any, src: int, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: Any, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           **kwargs: Any) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[Any], tensor: Any, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: Any, tensor: Any, group: Any = None, async_op: bool = False,
                           **kwargs: Any) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: Any, tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False, **kwargs: Any) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: Any, tensor: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                      group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def send(tensor: Any, dst: int, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: Any, dst: int, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, **kwargs: Any) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def broadcast_object_list(object_list: list[Any], src: int, group: Any = None, device: Any = None,
                          **kwargs: Any) -> None:
    dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None, **kwargs: Any) -> None:
    dist.all_gather_object(object_list, obj, group=group)


__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
           "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "destroy_process_group",
           "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed",
           "irecv", "is_available", "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter_tensor",
           "send"]


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's ``deepspeed.comm.log_summary()``: the communication log's table (``comms_logger``), printed
    on rank 0 (``zeroplus/comms_log.py``; the straggler is in the table whenever one was found)."""
    log = comms_log.current()
    text = log.summary() if log is not None else "comms_logger is not enabled: set \"comms_logger\": " \
                                                 "{\"enabled\": true} in the config"
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(text, flush=True)


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: with ``enabled`` true, start this process's communication log
    (an engine whose config enables ``comms_logger`` starts it too)."""
    if enabled:
        comms_log.process_log(True if prof_all is None else prof_all, prof_ops, bool(verbose))
