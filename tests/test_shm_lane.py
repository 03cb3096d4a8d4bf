"""Shared-memory lanes (issue 27, `protocol/shm_lane.py`): the native forward's latents between the client and the
ranks without a socket. The lane path returns the by-value path's result bit for bit; a rank killed during a
forward gives the client the fleet's clear error and the next forward works (on a fresh lane); no lane name is left
in /dev/shm after a job, after the fleet stops, or after a client dies (before or during its job).

The lane's protocol level is checked in this process (a lane made and mapped twice); the rest through the real
controller and a W = 2 CPU fleet (gloo) of the tiny LTX-2.3 model."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _procs import deadline, stop_controller
from test_controller import short_runtime_dir

from mgpu_backend.protocol.native_forward import ForwardReply, ForwardRequest
from mgpu_backend.protocol import shm_lane
from mgpu_backend.protocol.errors import ControllerError
from mgpu_backend.protocol.job_requests import FaultSpec, JobSpec, NoopRequest
from mgpu_backend.protocol.transport import Pickled, wire_job

pytestmark = pytest.mark.skipif(not shm_lane.supported(), reason="lanes need /dev/shm (Linux)")
ROOT = Path(__file__).resolve().parent.parent
GRID = (4, 6, 8)  # latent frames, height, width: 192 video tokens, a 196 KiB float32 video latent per row
AUDIO_STEPS = 24


def _lanes_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(shm_lane.SHM_DIR) if n.startswith(f"{shm_lane.PREFIX}{pid}{shm_lane.LANE_TAG}"))


def _all_lanes() -> set[str]:
    return {n for n in os.listdir(shm_lane.SHM_DIR) if shm_lane._pid_of(n) is not None}


# ---- in this process -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tensor", [
    torch.randn(2, 128, 3, 5, 8).bfloat16(), torch.randn(70, 80), torch.arange(9000, dtype=torch.int64),
    torch.ones(100, 200, dtype=torch.bool), torch.randn(120, 90).t(), torch.randn(50, 60).to(torch.float8_e4m3fn),
    torch.randn(40, 80, dtype=torch.complex64), torch.randn(3, 2)])  # the last one: too small, by value
def test_lane_round_trip_is_exact_and_copies(tensor):
    """Every dtype and layout comes back equal through the lane, as a fresh tensor (not a view of the lane)."""
    lanes = shm_lane.ClientLanes()
    try:
        wired = wire_job(JobSpec("noop", NoopRequest(carry={"t": tensor})), lanes)
        nbytes = tensor.numel() * tensor.element_size()
        assert (wired.payload.lane is not None) == (nbytes >= shm_lane.LANE_MIN_TENSOR_BYTES)
        assert len(wired.payload.data) < 4096 or wired.payload.lane is None  # the bytes are in the lane
        back = wired.payload.load().carry["t"]
        raw = (lambda t: t.contiguous().view(torch.uint8)) if tensor.dtype == torch.float8_e4m3fn else (lambda t: t)
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(raw(back), raw(tensor))
        before = back.clone()
        wire_job(JobSpec("noop", NoopRequest(carry={"t": torch.zeros_like(tensor)})), lanes)  # the lane rewritten
        assert torch.equal(raw(back), raw(before))
    finally:
        lanes.drop()
    assert _lanes_of(os.getpid()) == []


def test_reply_region_too_small_goes_by_value_and_grows_the_next_lane():
    lanes = shm_lane.ClientLanes()
    try:
        wired = wire_job(JobSpec("forward", {"x": torch.randn(64, 1024)}), lanes)
        small = wired.payload.reply({"v": torch.randn(32, 1024)})
        assert small.lane == wired.payload.lane and small.lane_short == 0
        big = wired.payload.reply({"v": torch.randn(256, 1024), "w": torch.randn(8)})
        assert big.lane is None and big.lane_short == 256 * 1024 * 4  # all by value; what it would have needed
        assert big.load()["v"].shape == (256, 1024)
        lanes.reply_bytes = big.lane_short
        old = lanes.lane.ref.name
        again = wire_job(JobSpec("forward", {"x": torch.randn(64, 1024)}), lanes)
        assert again.payload.lane.name != old and again.payload.lane.size - again.payload.lane.request_bytes >= big.lane_short
        assert again.payload.reply({"v": torch.randn(256, 1024)}).lane == again.payload.lane
        assert not os.path.exists(os.path.join(shm_lane.SHM_DIR, old))  # the replaced lane's name is gone
    finally:
        lanes.drop()
    assert _lanes_of(os.getpid()) == []


def test_a_lane_whose_name_is_gone_cannot_be_mapped_and_names_are_checked():
    lanes = shm_lane.ClientLanes()
    try:
        wired = wire_job(JobSpec("noop", NoopRequest(carry=torch.randn(64, 1024))), lanes)
        ref = wired.payload.lane
        lanes.lane.unlink()
        assert _lanes_of(os.getpid()) == []
        assert wired.payload.load().carry.shape == (64, 1024)  # this process still maps it (its own lane)
        with pytest.raises(shm_lane.LaneMissing, match="is gone"):
            shm_lane.Lane.attach(ref)
        with pytest.raises(ValueError, match="not a shared-memory lane name"):
            shm_lane.Lane.attach(dataclasses.replace(ref, name="../etc/passwd"))
        with pytest.raises(ValueError, match="not a shared-memory lane name"):
            shm_lane.unlink_lane("ltx2mgpu-123-456")  # a frames block, not a lane
    finally:
        lanes.drop()


def test_over_the_size_limit_or_switched_off_takes_the_old_path(monkeypatch):
    monkeypatch.setattr(shm_lane, "LANE_MAX_BYTES", 1 << 20)
    lanes = shm_lane.ClientLanes()
    wired = wire_job(JobSpec("noop", NoopRequest(carry=torch.randn(1024, 1024))), lanes)  # 4 MiB
    assert isinstance(wired.payload, Pickled) and wired.payload.lane is None and lanes.lane is None
    monkeypatch.setattr(shm_lane, "LANE_MAX_BYTES", 512 << 20)
    monkeypatch.setattr(shm_lane, "shm_free", lambda: 60 << 20)  # a small /dev/shm: a lane up to 15 MiB
    big = wire_job(JobSpec("noop", NoopRequest(carry=torch.randn(2048, 1024))), lanes)  # 8 + 8 MiB: too large
    assert isinstance(big.payload, NoopRequest) and lanes.lane is None  # over 8 MiB by value too: torch's shm files
    small = wire_job(JobSpec("noop", NoopRequest(carry=torch.randn(1024, 1024))), lanes)  # 4 + 4 MiB
    assert small.payload.lane is not None
    lanes.drop()
    stage = JobSpec("frames", {"x": torch.randn(64, 1024)})
    assert wire_job(stage, lanes) is stage
    monkeypatch.setenv("LTX2_MGPU_SHM_LANE", "0")
    assert not shm_lane.enabled_by_default()


def test_dead_clients_lanes_are_removed():
    code = ("import os, signal, sys; sys.path.insert(0, %r); from mgpu_backend.protocol import shm_lane; "
            "lane = shm_lane.Lane.create(4096, 4096); print(lane.ref.name, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)").replace("%r", repr(str(ROOT)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    name = proc.stdout.strip()
    assert proc.returncode == -signal.SIGKILL and os.path.exists(os.path.join(shm_lane.SHM_DIR, name))
    assert name in shm_lane.remove_dead_lanes()
    assert not os.path.exists(os.path.join(shm_lane.SHM_DIR, name))


def _client_without_controller(runtime: Path, outcomes: list):
    """A `ControllerClient` whose `_run` (the socket exchange) answers from `outcomes`: an exception to raise or a
    result (its payload as the ranks would read it, to check what was sent)."""
    from mgpu_backend.serving.client import ControllerClient

    client = object.__new__(ControllerClient)
    client.runtime_dir, client.shm_lane = runtime, True
    sent = []

    def fake_run(job, lanes, *args):
        sent.append(job)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return job.payload.load() if isinstance(job.payload, Pickled) else job.payload

    client._run = fake_run
    return client, sent


def test_client_drops_the_lane_on_busy_on_a_lost_connection_and_resends_by_value_when_it_is_missing(tmp_path):
    """A new lane refused as busy is dropped (its name never left); a lost connection drops the lane; `LaneMissing`
    on the ranks: the lane dropped and the job sent again by value, its result returned."""
    from mgpu_backend.protocol.errors import FleetBusy

    carry = torch.randn(256, 1024)
    job = JobSpec("noop", NoopRequest(carry=carry))
    lanes = shm_lane.client_lanes(str(tmp_path))
    client, sent = _client_without_controller(tmp_path, [FleetBusy("busy", kind="busy")])
    with pytest.raises(FleetBusy):
        client.run(None, job)
    assert sent[0].payload.lane is not None and lanes.lane is None and _lanes_of(os.getpid()) == []
    client, sent = _client_without_controller(tmp_path, [EOFError("the controller went away")])
    with pytest.raises(EOFError):
        client.run(None, job)
    assert lanes.lane is None and _lanes_of(os.getpid()) == []
    missing = ControllerError("LaneMissing: gone", kind="job_error", details={"error_type": "LaneMissing"})
    client, sent = _client_without_controller(tmp_path, [missing, "by value"])
    out = client.run(None, job)
    assert [j.payload.lane is not None for j in sent] == [True, False]  # the lane, then by value
    assert torch.equal(out.carry, carry) and lanes.lane is None and _lanes_of(os.getpid()) == []
    client, sent = _client_without_controller(tmp_path, [None])
    client.run(None, job)  # a new lane again
    assert sent[0].payload.lane is not None and lanes.lane is not None
    lanes.drop()
    assert _lanes_of(os.getpid()) == []


# ---- through the controller and a W = 2 fleet ---------------------------------------------------------------------

def _request(seed: int) -> ForwardRequest:
    g = torch.Generator().manual_seed(seed)
    f, h, w = GRID
    return ForwardRequest(
        video=torch.randn(2, 128, f, h, w, generator=g), audio=torch.randn(2, 8, AUDIO_STEPS, 16, generator=g),
        video_timestep=torch.tensor([0.7, 0.7]), audio_timestep=torch.tensor([0.7, 0.7]),
        context=torch.randn(2, 32, 96, generator=g), context_keys=(), frame_rate=25.0, cond_or_uncond=(1, 0))


@pytest.fixture(scope="module")
def fleet(tiny_dir):
    from mgpu_backend.serving.client import ControllerClient
    from mgpu_backend.protocol.fleet_config import FleetConfig

    runtime = short_runtime_dir()
    client = ControllerClient(runtime_dir=runtime)
    files = tiny_dir["2.3"]
    handle = client.configure(FleetConfig(devices=("cpu", "cpu"), checkpoint=str(files["checkpoint"]),
                                          gemma=None, dtype="float32", threads_per_worker=1, transformer_only=True,
                                          init_timeout_s=180.0, collective_timeout_s=120.0, stall_timeout_s=120.0))
    yield client, handle, runtime
    client.close()
    stop_controller(runtime)
    import shutil

    shutil.rmtree(runtime, ignore_errors=True)


def test_lane_equals_by_value_and_survives_a_killed_rank(fleet):
    """Bit for bit: the same forwards by value (shm_lane=False) and through the lane; the lane's name is gone after
    its first job. A rank SIGKILLed as its forward starts: the client gets the fleet's error naming the rank; the
    next forward (a new fleet, which cannot map the old lane: sent again by value, transparently) equals the first
    result, and the one after runs on a new lane. No lane name is left."""
    from mgpu_backend.serving.client import ControllerClient

    client, handle, runtime = fleet
    with deadline(600, "lane fleet test"):
        requests = [_request(s) for s in (1, 2)]
        by_value = ControllerClient(runtime, shm_lane=False)
        try:
            expected = [by_value.run(handle, JobSpec("forward", r)) for r in requests]
        finally:
            by_value.close()
        lanes = shm_lane.client_lanes(str(runtime))
        assert client.shm_lane
        got = []
        for r in requests + requests:
            reply = client.run(handle, JobSpec("forward", r))
            assert lanes.lane is not None and _lanes_of(os.getpid()) == []  # used, and its name already gone
            got.append(reply)
        for reply, want in zip(got, expected + expected):
            assert isinstance(reply, ForwardReply)
            assert torch.equal(reply.video, want.video) and torch.equal(reply.audio, want.audio)
        first_lane = lanes.lane.ref.name

        workers = client.status().fleet.worker_pids

        def kill_rank1(accepted):
            os.kill(workers[1], signal.SIGKILL)

        with pytest.raises(ControllerError, match=r"worker rank 1 .*died with exit code -9 \(SIGKILL\)") as info:
            client.run(handle, JobSpec("forward", requests[0]), on_accepted=kill_rank1)
        assert info.value.fleet_lost
        again = client.run(handle, JobSpec("forward", requests[1]))  # a new fleet: by value, the lane dropped
        assert torch.equal(again.video, expected[1].video) and torch.equal(again.audio, expected[1].audio)
        assert client.status().fleet.worker_pids != workers
        last = client.run(handle, JobSpec("forward", requests[0]))
        assert lanes.lane is not None and lanes.lane.ref.name != first_lane  # a new lane for the new fleet
        assert torch.equal(last.video, expected[0].video) and torch.equal(last.audio, expected[0].audio)
        assert _lanes_of(os.getpid()) == []


CLIENT = '''
import os, signal, sys, time
sys.path.insert(0, {root!r})
from mgpu_backend.serving.client import ControllerClient
from mgpu_backend.protocol.job_requests import JobSpec, NoopRequest
import torch, pickle
handle = pickle.loads(bytes.fromhex({handle!r}))
client = ControllerClient({runtime!r}, start=False)
client.run(handle, JobSpec("noop", NoopRequest(carry=torch.randn(256, 1024))))  # a lane, its name gone after
def die(accepted):
    print("accepted", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
from mgpu_backend.protocol import shm_lane
shm_lane.client_lanes(client.runtime_dir.as_posix()).drop()  # a fresh lane: its name is still there during the job
client.run(handle, JobSpec("noop", NoopRequest(steps=50, sleep_s=0.1, carry=torch.randn(256, 1024))),
           on_accepted=die)
'''


def test_no_lane_is_left_when_a_client_dies_during_its_job_or_the_fleet_stops(fleet):
    """A client SIGKILLed while its first job on a new lane runs (the name still there): the controller unlinks it
    when the job ends (cancelled: its client went away). Then the fleet stops: no lane of ours is left."""
    import pickle

    client, handle, runtime = fleet
    with deadline(300, "dead client test"):
        before = _all_lanes()
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CLIENT).format(
            root=str(ROOT), runtime=str(runtime), handle=pickle.dumps(handle).hex())],
            capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == -signal.SIGKILL and "accepted" in proc.stdout, proc.stderr
        end = time.monotonic() + 60
        # the job is cancelled at its next step (its client went away) and the controller unlinks the lane then
        while time.monotonic() < end and (_all_lanes() - before):
            time.sleep(0.1)
        assert _all_lanes() - before == set()
        client.run(handle, JobSpec("noop", NoopRequest()))  # the fleet serves on
        client.shutdown_fleet()
        assert _all_lanes() - before == set() and _lanes_of(os.getpid()) == []


def test_a_rank_stalled_during_a_lane_job_is_named_and_the_next_forward_works(tiny_dir, monkeypatch):
    """A rank that stalls during a job whose tensors are in a lane (the noop, with the test fault switch): the
    client gets the fleet's stall error naming the rank; the next forward runs on a new fleet; no lane is left."""
    from mgpu_backend.serving.client import ControllerClient
    from mgpu_backend.protocol.fleet_config import FleetConfig

    monkeypatch.setenv("LTX2_MGPU_TEST_FAULTS", "1")  # inherited by the controller started here
    runtime = short_runtime_dir()
    try:
        with deadline(300, "stalled rank test"):
            client = ControllerClient(runtime_dir=runtime)
            files = tiny_dir["2.3"]
            handle = client.configure(FleetConfig(devices=("cpu", "cpu"), checkpoint=str(files["checkpoint"]),
                                                  gemma=None, dtype="float32", threads_per_worker=1,
                                                  transformer_only=True, init_timeout_s=180.0,
                                                  collective_timeout_s=120.0, stall_timeout_s=5.0))
            stall = FaultSpec(stage="noop", step=1, kind="stall", rank=1)
            with pytest.raises(ControllerError, match=r"no progress for 5 s: rank 1 stalled") as info:
                client.run(handle, JobSpec("noop", NoopRequest(steps=3, carry=torch.randn(256, 1024)), fault=stall))
            assert info.value.fleet_lost
            assert _lanes_of(os.getpid()) == []
            reply = client.run(handle, JobSpec("forward", _request(1)))
            assert isinstance(reply, ForwardReply) and reply.video.shape == (2, 128, *GRID)
            client.close()
    finally:
        stop_controller(runtime)
        import shutil

        shutil.rmtree(runtime, ignore_errors=True)
    assert _lanes_of(os.getpid()) == []
