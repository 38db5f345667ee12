"""Runs a worker function in ``world_size`` spawned processes joined by a gloo process group.

Each worker returns a picklable result (tensors, numbers, dicts); the parent gets the list of
results, one per rank, and makes the assertions.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank leaves while another still uses the group
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_quietly()


def leave_quietly() -> None:
    """Ends a spawned rank whose results are saved, without C++ destructors: gloo's teardown
    has aborted ("terminate called without an active exception") on a loaded 2-core machine
    after every result was written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(worker, out_dir: Path, *args, world_size: int = 2) -> list:
    """Runs ``worker(rank, world_size, *args)`` on every rank; returns the results by rank."""
    mp.spawn(
        _entry,
        args=(worker, world_size, free_port(), str(out_dir), args),
        nprocs=world_size,
        join=True,
    )
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
