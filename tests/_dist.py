"""Run a function on W gloo ranks (CPU) and collect what each rank returns — for tests with real process groups.

`run_ranks(fn, world_size, *args)` spawns W processes (`torch.multiprocessing.spawn`, the "spawn" start method),
each initializes the default process group with backend gloo (or `backend=`) and a `file://` rendezvous in a fresh
temporary folder, sets `torch.set_num_threads(1)`, calls `fn(rank, world_size, *args)` and `torch.save`s its return
value to a file of that folder; the parent loads the files and returns the list of per-rank results (rank 0 first).

`fn` must be importable by the children (a module-level function of a test module or of this helper); its return
value must be `torch.save`-able (tensors, numbers, strings, dicts, lists). An exception in any rank fails the call
with that rank's traceback (`torch.multiprocessing.ProcessRaisedException`); a rank that dies without one fails it
with `ProcessExitedException`. Collectives time out after `timeout_s` so a rank that hangs cannot hang the tests.

The ranks import `mgpu_backend` (and `fn`'s test module) afresh from disk, while the tests compare them with
references this process computed with the code it imported at collection. When the source tree is edited while a
long session runs (a 13-minute suite in a shared checkout), the two sides run different code and a parity test fails
with a numeric error that looks like a bug (seen: commit f303e7e changed `default_tiling`'s overlaps mid-run, and
`test_three_ranks_sp_on_two` reported a relative error of 2.2e-2). `run_ranks` therefore refuses to spawn, naming
the changed files, when the source of an imported engine / nodes module, of `fn`'s test module or of this helper differs
from its state at collection.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_REPO = Path(__file__).resolve().parent.parent
_PACKAGES = ("mgpu_backend", "nodes")  # packages of this checkout the ranks import (and the test modules)


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return "missing"


# file -> digest at collection (this module is imported while the test modules are collected, right after conftest
# and the test modules imported mgpu_backend)
_SESSION_SOURCES: dict[Path, str] = {p: _digest(p) for d in (*_PACKAGES, "tests")
                                      for p in (_REPO / d).rglob("*.py")}


def _rank_sources(fn: Callable) -> list[Path]:
    """The files whose code both this process and the ranks run: the imported modules of the engine and the nodes,
    `fn`'s test module and this helper (other test modules, edited or not, are not imported by the ranks)."""
    out = {Path(__file__).resolve()}
    fn_module = sys.modules.get(getattr(fn, "__module__", None) or "")
    for module in [fn_module, *(m for name, m in list(sys.modules.items()) if name.split(".")[0] in _PACKAGES)]:
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() in _SESSION_SOURCES:
            out.add(Path(file).resolve())
    return sorted(out)


def check_sources_unchanged(fn: Callable) -> None:
    """Raise RuntimeError naming the files that changed on disk since collection (see the module docstring): the
    ranks would run other code than the references this process computed."""
    changed = [p for p in _rank_sources(fn) if _digest(p) != _SESSION_SOURCES[p]]
    if changed:
        names = ", ".join(str(p.relative_to(_REPO)) for p in changed)
        raise RuntimeError(f"source files changed on disk during this test session: {names}. The spawned ranks would "
                           f"import the new code while this process computed its references with the old; rerun "
                           f"the tests (run long suites from a snapshot of the tree, not from a checkout being edited)")


def _entry(rank: int, fn: Callable, world_size: int, folder: str, timeout_s: float, args: tuple,
           backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
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


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
              backend: str = "gloo") -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; returns the per-rank results in rank order.
    `backend`: the process-group backend ("nccl" needs one GPU per rank; `fn` then picks its device before its first
    collective). Raises RuntimeError before spawning when the sources changed since this process imported them."""
    check_sources_unchanged(fn)
    with tempfile.TemporaryDirectory(prefix="sp_ranks_") as folder:
        mp.spawn(_entry, args=(fn, world_size, folder, timeout_s, args, backend), nprocs=world_size, join=True)
        return [torch.load(Path(folder) / f"result_{r}.pt", weights_only=False) for r in range(world_size)]
