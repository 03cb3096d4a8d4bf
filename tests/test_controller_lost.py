"""A controller lost at any moment (issue 36 item 2): during a client's handshake, while a fleet starts (its workers
spawned, still importing), and during a job. The client raises a ControllerError of kind "controller_lost" naming
what was lost, when, and what to do (never a raw EOFError with an empty message), and the controller's workers are
gone within 2 s of its death (they bind to it before any heavy import: `serving/worker_start.py`).

Real processes: a controller per test (its own runtime directory), gloo CPU ranks of the tiny model, the controller
ended with SIGKILL as the OOM killer would end it.
"""
from __future__ import annotations

import json
import multiprocessing.connection as mpc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mgpu_backend.protocol.errors import ControllerError, ErrorKind
from mgpu_backend.protocol.fleet_config import FleetConfig
from mgpu_backend.protocol.job_requests import JobSpec, NoopRequest
from mgpu_backend.serving.client import ControllerClient
from _procs import deadline, process_alive, stop_controller, wait_gone

GUARD_S = 240
GONE_WITHIN_S = 2.0  # the bound: a dead controller's workers are gone within 2 s


@pytest.fixture(autouse=True)
def _hang_guard(request):
    with deadline(GUARD_S, request.node.name):
        yield


@pytest.fixture
def runtime():
    path = Path(tempfile.mkdtemp(prefix="ltx2-cl-"))  # AF_UNIX paths are limited to 107 bytes
    yield path
    stop_controller(path)
    shutil.rmtree(path, ignore_errors=True)


def config(tiny_dir, ranks: int = 2, **overrides) -> FleetConfig:
    files = tiny_dir["2.0"]
    args = dict(devices=("cpu",) * ranks, checkpoint=str(files["checkpoint"]), gemma=str(files["gemma"]),
                upscaler=str(files["upsampler"]), dtype="float32", threads_per_worker=1, init_timeout_s=120.0)
    args.update(overrides)
    return FleetConfig(**args)


def pid_files(directory: Path) -> list[int]:
    out = []
    for p in directory.glob("*.json"):
        try:
            out.append(json.loads(p.read_text())["pid"])
        except (OSError, ValueError, KeyError):  # being written
            pass
    return sorted(out)


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def kill(pid: int) -> float:
    """SIGKILL `pid` (a controller this test started) and wait until it is gone; the time it died (monotonic)."""
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid], timeout=30)
    return time.monotonic()


def assert_gone_within(pids, since: float) -> None:
    left = GONE_WITHIN_S - (time.monotonic() - since)
    assert wait_gone(pids, timeout=max(0.0, left)), (
        f"workers {[p for p in pids if process_alive(p)]} still alive {GONE_WITHIN_S} s after their controller died")


SLOW_TORCH = """\
import os, sys, time

class _SlowTorch:  # tests/test_controller_lost.py: torch's import made as slow as a CUDA torch's under load
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(float(os.environ["LTX2_TEST_SLOW_TORCH_S"]))
        return None

if os.environ.get("LTX2_TEST_SLOW_TORCH_S"):
    sys.meta_path.insert(0, _SlowTorch())
"""


@pytest.fixture
def slow_torch(tmp_path, monkeypatch):
    """The controller this test starts, and its workers, take 5 s longer to import torch (a `sitecustomize` on
    their PYTHONPATH): the issue measured workers importing for 2.5-5.3 s on a live ComfyUI's CUDA torch, longer than
    the CPU torch here takes."""
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_TORCH)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "slow"),
                                                                    os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("LTX2_TEST_SLOW_TORCH_S", "5")


def test_lost_while_the_fleet_starts_names_the_moment_and_leaves_no_worker(tiny_dir, runtime, slow_torch):
    """The issue's case: the controller killed right after it spawned the workers (they are still importing torch):
    before, they lived 2.5-5.3 s on and the loader failed with a bare EOFError."""
    client = ControllerClient(runtime)
    controller = client.ping().pid
    outcome: dict = {}

    def configure():
        try:
            client.configure(config(tiny_dir))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=configure, daemon=True)
    thread.start()
    while len(spawned := pid_files(runtime / "workers")) < 2:
        time.sleep(0.005)
    importing = [p for p in spawned if not comm(p).startswith("ltx2mgpu-rank")]  # not yet in worker_main
    died = kill(controller)
    assert_gone_within(spawned, died)
    thread.join(60)
    error = outcome.get("error")
    assert isinstance(error, ControllerError), outcome
    assert error.kind == ErrorKind.CONTROLLER_LOST and error.fleet_lost
    message = str(error)
    assert message.startswith(f"lost the multi-GPU controller (pid {controller}) while it set up the fleet for this "
                              f"configuration (2 rank(s) on cpu,cpu: starting workers that load the model, or reusing "
                              f"the running ones): the connection closed (EOFError), so it was killed or crashed"), \
        message
    assert "its workers end with it" in message and "run it again: the next request starts a new controller" in message
    assert f"{runtime / 'controller.log'}" in message
    assert importing, "the workers were already past their imports: the kill came too late to test the start"


def test_lost_during_a_job_names_the_job(tiny_dir, runtime):
    client = ControllerClient(runtime)
    handle = client.configure(config(tiny_dir))
    controller = client.status().pid
    job = JobSpec("noop", NoopRequest(steps=200, sleep_s=0.05))
    died = []

    def on_event(event):
        if not died:
            died.append(kill(controller))

    with pytest.raises(ControllerError) as info:
        client.run(handle, job, on_event=on_event)
    assert_gone_within(handle.worker_pids, died[0])
    assert info.value.kind == ErrorKind.CONTROLLER_LOST and info.value.fleet_lost
    assert str(info.value).startswith(f"lost the multi-GPU controller (pid {controller}) while job {job.job_id} "
                                      f"(noop) ran on fleet generation {handle.generation}: "), str(info.value)
    # the next client starts a new controller, which reaps nothing alive and serves
    again = ControllerClient(runtime)
    assert again.ping().pid != controller
    again.close()


def test_lost_during_the_handshake(tiny_dir, runtime, monkeypatch):
    """The controller (with a fleet up) killed while a client answers its auth challenge: start=False says no
    controller answers, naming the handshake; start=True starts a new controller; the old fleet's workers are gone
    within 2 s."""
    first = ControllerClient(runtime)
    handle = first.configure(config(tiny_dir, ranks=1))
    controller = first.status().pid
    first.close()
    real = mpc.answer_challenge
    died = []

    def answer_then_lose(connection, authkey):
        if not died:
            died.append(kill(controller))
        return real(connection, authkey)

    monkeypatch.setattr(mpc, "answer_challenge", answer_then_lose)
    with pytest.raises(ControllerError) as info:
        ControllerClient(runtime, start=False)
    assert info.value.kind == ErrorKind.NOT_RUNNING
    assert str(info.value).startswith(f"no controller answers on {runtime / 'controller.sock'}: the controller went "
                                      f"away during the connection's handshake ("), str(info.value)
    assert_gone_within(handle.worker_pids, died[0])
    monkeypatch.setattr(mpc, "answer_challenge", real)
    second = ControllerClient(runtime)
    assert second.started_pid is not None and second.ping().pid not in (None, controller)
    second.close()


def test_a_worker_binds_to_its_controller_before_importing_torch():
    """What makes the start case hold: the modules a spawned worker imports before it binds to its parent (the
    controller's module, run again as the child's `__mp_main__`, and the worker's entry point) import no torch."""
    code = ("import sys; import mgpu_backend.serving.controller, mgpu_backend.serving.worker_start; "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
