"""A worker's entry point, bound to its controller before anything heavy is imported (issue 36).

A spawned worker imports, before its first line runs, what its parent's main module imports (the controller's
module, run again as `__mp_main__`) and what its arguments name; then `start` binds it to the controller
(`bind_to_parent`: Linux's parent-death signal and a watched pipe) and only then imports the worker (torch, the
models: seconds on a CUDA torch). This module and the controller's module import no torch
(tests/test_controller_lost.py checks it), so a controller killed while its fleet starts leaves no worker behind
for longer than a Python start: before, workers still importing torch outlived it by 2.5-5.3 s.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

# a worker's exit code when its controller is gone (it exits on its own, `bind_to_parent`)
EXIT_PARENT_GONE = 75

_bound = False


@dataclass(frozen=True)
class WorkerLinks:
    """How a spawned worker reaches its fleet (handed to `start` by `Fleet`, pickled with the process's
    arguments): `conn` its end of the duplex pipe to the fleet (messages of protocol/worker_messages.py),
    `cancel_flag` (multiprocessing.Value('i'), set by the controller, read by rank 0), `heartbeat`
    (multiprocessing.Array('d', 2 * world_size): per rank steps done and wall time), `parent_pid` (the controller)
    and `watch` (the read end of a pipe whose write end only the parent holds: `bind_to_parent`)."""

    conn: Any
    cancel_flag: Any
    heartbeat: Any
    parent_pid: int
    watch: Any


def bind_to_parent(parent_pid: int, watch) -> None:
    """Make this worker end with the process that spawned it (the controller), within a second, however that one
    ends (SIGKILL, the OOM killer): Linux's parent-death signal (SIGKILL), and everywhere a thread that waits on
    `watch`, the read end of a pipe whose only write end the parent holds, and exits (`EXIT_PARENT_GONE`) when it
    closes. A parent already gone ends this process at once. Idempotent (a second call does nothing)."""
    global _bound
    if _bound:
        return
    from ..protocol.resources import kill_on_parent_death

    kill_on_parent_death()
    if os.getppid() != parent_pid:  # the parent died before the signal was set
        os._exit(EXIT_PARENT_GONE)

    def wait_for_close() -> None:
        try:
            while True:
                watch.recv()  # nothing is ever sent: this returns only by EOF when the parent is gone
        except (EOFError, OSError):
            os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=wait_for_close, name="ltx2-mgpu-parent-watch", daemon=True).start()
    _bound = True


def start(rank: int, identity, policy, init_file: str, links: WorkerLinks) -> None:
    """The process target `Fleet` spawns: bind to the controller (`bind_to_parent`), then import the worker and run
    `worker.worker_main(rank, identity, policy, init_file, links)`."""
    bind_to_parent(links.parent_pid, links.watch)
    from .worker import worker_main

    worker_main(rank, identity, policy, init_file, links)
