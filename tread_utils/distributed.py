"""Processes: how every entry point checks its process count against the GPUs, starts its accelerate state,
sets its CPU threads, and gathers Python objects to the main process.

Timeout: a collective (a barrier, a gather) waits this long for the slowest rank before failing. torch's
default is 10 minutes on NCCL, shorter than what one rank may legitimately spend alone: scoring an
in-training FID on the main process, writing a checkpoint to a slow disk, compiling, or a resumed
latent extraction whose ranks have little left to do.
"""
import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

from tread_utils.errors import UserError

DEFAULT_TIMEOUT_MINUTES = 60


def start_processes(timeout_minutes=DEFAULT_TIMEOUT_MINUTES, **accelerator_kwargs):
    """accelerate's `Accelerator` (kwargs as given: cpu, mixed_precision, ...) whose process group, if any,
    waits `timeout_minutes` in a collective before failing."""
    from accelerate import Accelerator  # deferred: importing tread_utils must stay cheap
    from accelerate.utils import InitProcessGroupKwargs

    try:
        minutes = float(timeout_minutes)
    except (TypeError, ValueError):
        minutes = float("nan")
    if not minutes > 0:
        raise UserError(f"the process-group timeout must be a positive number of minutes, got {timeout_minutes!r}")
    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=minutes))
    return Accelerator(kwargs_handlers=[timeout], **accelerator_kwargs)


def check_cuda_processes(local_processes=None, mixed_precision: str = "no"):
    """On CUDA every process of a node takes its own device (rank r -> cuda:r): refuse more processes per node
    than visible devices, which would otherwise fail later with `invalid device ordinal`. `local_processes`
    defaults to the launcher's LOCAL_WORLD_SIZE (1 without a launcher). fp16 needs CUDA: elsewhere accelerate
    neither autocasts to float16 nor scales the loss, and the run would silently train in float32."""
    if mixed_precision == "fp16" and not torch.cuda.is_available():
        raise UserError("train.mixed_precision=fp16 needs a CUDA GPU: without one accelerate neither autocasts to "
                        "float16 nor makes a grad scaler, so the run would train in float32; use bf16 or no")
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices and local_processes > devices:
        raise UserError(f"{local_processes} processes per node but {devices} CUDA device(s) visible: launch at most "
                        f"{devices} per node (accelerate launch --num_processes N), or list the devices to use in "
                        f"CUDA_VISIBLE_DEVICES (CUDA_VISIBLE_DEVICES=\"\" runs every process on the CPU)")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one (a cluster job's cgroup, a
    pinned test worker), else the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_cpu_threads(setting, local_processes: int) -> int:
    """torch's and the BLAS libraries' threads in this process: `auto` = this machine's cores shared by
    its `local_processes` (`available_cores`), or an integer. On every device: `accelerate launch` pins OMP_NUM_THREADS=1,
    which on a GPU run leaves the main process's CPU work (the FID metric stage, numpy, scipy's sqrtm)
    one core. DataLoader workers set their own (torch gives each one thread)."""
    if setting == "auto":
        threads = max(1, available_cores() // max(1, int(local_processes)))
    else:
        try:
            threads = int(setting)
        except (TypeError, ValueError):
            threads = 0
        if threads < 1 or str(threads) != str(setting).strip():
            raise UserError(f"train.cpu_threads must be auto or a positive integer, got {setting!r}")
    torch.set_num_threads(threads)
    from threadpoolctl import threadpool_limits  # numpy/scipy read OMP_NUM_THREADS once, at import

    threadpool_limits(limits=threads)
    return threads


def gather_to_main(obj, world: int, rank: int):
    """[obj of rank 0, ..., obj of rank W-1] on the main process, None elsewhere (one process: [obj])."""
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def gather_rows(arrays: dict, indices, world: int, rank: int, extra=None):
    """Every rank holds some rows of the same arrays, at positions `indices` of the whole; the main process
    gets ({name: the whole array, rows in position order}, [extra of rank 0, ..., rank W-1]), the others
    (None, None). The ranks' indices must cover 0..N-1 exactly once. Every rank must call this."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    parts = gather_to_main((indices, arrays, extra), world, rank)
    if parts is None:
        return None, None
    every = np.concatenate([p[0] for p in parts])
    total = len(every)
    if not np.array_equal(np.sort(every), np.arange(total)):
        raise ValueError(f"the ranks' indices do not cover 0..{total - 1} exactly once")
    whole = {}
    for part_indices, part_arrays, _ in parts:
        for name, rows in part_arrays.items() if len(part_indices) else ():
            rows = np.asarray(rows)
            if rows.shape[0] != len(part_indices):
                raise ValueError(f"{name}: {rows.shape[0]} rows for {len(part_indices)} indices")
            if name not in whole:
                whole[name] = np.empty((total, *rows.shape[1:]), dtype=rows.dtype)
            whole[name][part_indices] = rows
    return whole, [p[2] for p in parts]


def fully_shard_blocks(model: torch.nn.Module, blocks, **options) -> int:
    """FSDP2: `fully_shard(block, **options)` for each of `blocks`, then for `model` (the root), so a block's
    parameters are gathered only around its own forward and backward; returns the number of blocks."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(blocks)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return len(blocks)
