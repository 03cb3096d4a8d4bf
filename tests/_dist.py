"""Run a function on W gloo ranks (CPU) and collect what each rank returns — for tests with real process groups.

`run_ranks(fn, world_size, *args)` spawns W processes (`torch.multiprocessing.spawn`, the "spawn" start method),
each initializes the default process group with backend gloo and a `file://` rendezvous in a fresh temporary
folder, sets `torch.set_num_threads(1)`, calls `fn(rank, world_size, *args)` and `torch.save`s its return value to
a file of that folder; the parent loads the files and returns the list of per-rank results (rank 0 first).

`fn` must be importable by the children (a module-level function of a test module or of this helper); its return
value must be `torch.save`-able (tensors, numbers, strings, dicts, lists). An exception in any rank fails the call
with that rank's traceback (`torch.multiprocessing.ProcessRaisedException`); a rank that dies without one fails it
with `ProcessExitedException`. Collectives time out after `timeout_s` so a rank that hangs cannot hang the tests.
"""
from __future__ import annotations

import datetime
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, folder: str, timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()  # every rank finished its collectives before any tears the group down
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{folder}/result_{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter teardown (seconds per rank with torch loaded); the result is on disk


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; returns the per-rank results in rank order."""
    with tempfile.TemporaryDirectory(prefix="sp_ranks_") as folder:
        mp.spawn(_entry, args=(fn, world_size, folder, timeout_s, args), nprocs=world_size, join=True)
        return [torch.load(Path(folder) / f"result_{r}.pt", weights_only=False) for r in range(world_size)]
