"""Run a function on 2 processes (gloo, CPU) and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.save(fn(rank, *args), Path(out) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(fn: Callable, *args) -> list:
    """`fn(rank, *args)` on each of 2 ranks; returns their results in rank order."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(fn, _free_port(), out, args), nprocs=WORLD, join=True)
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(WORLD)]
