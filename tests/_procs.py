"""Process helpers shared by the fleet / controller tests: a hang guard and checks that processes are gone."""
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
