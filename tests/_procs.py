"""Process helpers shared by the fleet / controller tests: a hang guard, checks that processes are gone, stopping a
test's controller."""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager


@contextmanager
def deadline(seconds: float, what: str):
    """Raise TimeoutError in this (main) thread if the block runs longer than `seconds`: a hang fails the test."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what}: still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone; our own zombie children are reaped)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, timeout: float = 30.0) -> bool:
    """Wait until none of `pids` runs; False if some still do after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(process_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def stop_controller(runtime) -> None:
    """Stop the controller of the runtime directory `runtime` if one answers there, and make sure it and its workers
    are gone (killed if a stop does not end them)."""
    from mgpu_backend.serving.client import ControllerClient
    from mgpu_backend.protocol.errors import ControllerError

    pids = []
    try:
        client = ControllerClient(runtime, start=False)
        status = client.status()
        pids = [p.pid for p in status.processes] or [status.pid]
        client.stop()
    except (ControllerError, OSError, EOFError):
        pass
    if not wait_gone(pids):
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def bound_child(parent_pid: int, watch) -> None:
    """A spawned process bound to its parent as a worker is (`worker_start.bind_to_parent`), then idle."""
    from mgpu_backend.serving.worker_start import bind_to_parent

    bind_to_parent(parent_pid, watch)
    time.sleep(600)
