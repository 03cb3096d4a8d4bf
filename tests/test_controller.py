"""The background controller as its clients see it: private socket and key, reattaching, busy, stale handles,
shared-memory frames, the CLI, and a start from ComfyUI's mangled import outside the repository.

One controller for the module (own runtime dir) with a W = 1 CPU fleet on the tiny model, stopped at teardown;
the CLI `stop` and the mangled-import start use controllers of their own.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path

import pytest
import torch

from mgpu_backend.serving.client import ControllerClient
from mgpu_backend.protocol.errors import ControllerError, ErrorDetails, ErrorKind, FleetBusy, JobCancelled
from mgpu_backend.protocol.fleet_config import FleetConfig, FleetIdentity, FleetPlan, FleetPolicy
from mgpu_backend.protocol.job_requests import FaultSpec, FramesRequest, JobSpec, NoopRequest
from mgpu_backend.protocol.job_results import DecodeResult
from mgpu_backend.protocol.transport import KEY_NAME, SOCKET_NAME, ensure_private_dir
from _procs import deadline, process_alive as _alive, wait_gone

REPO = Path(__file__).resolve().parent.parent
GUARD_S = 180


@pytest.fixture(autouse=True)
def _hang_guard(request):
    with deadline(GUARD_S, request.node.name):
        yield


def stop_controller(runtime: Path) -> None:
    """Stop the controller of `runtime` (if one answers) and make sure it and its workers are gone."""
    pids = []
    try:
        client = ControllerClient(runtime, start=False)
        status = client.status()
        pids = [status.pid, *(status.fleet.worker_pids if status.fleet is not None else ())]
        client.stop()
    except (ControllerError, OSError, EOFError):  # EOFError: a controller stopping as we connected
        pass
    if not wait_gone(pids):
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def short_runtime_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ltx2-tc-"))  # AF_UNIX paths are limited to 107 bytes


def tiny_config(tiny_dir, **overrides) -> FleetConfig:
    files = tiny_dir["2.0"]
    args = dict(devices=("cpu",), checkpoint=str(files["checkpoint"]), gemma=str(files["gemma"]),
                upscaler=str(files["upsampler"]), dtype="float32", threads_per_worker=1, stall_timeout_s=60.0)
    args.update(overrides)
    return FleetConfig(**args)


@pytest.fixture(scope="module")
def runtime():
    path = short_runtime_dir()
    yield path
    stop_controller(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ctl(runtime):
    return ControllerClient(runtime_dir=runtime)


@pytest.fixture(scope="module")
def handle(ctl, tiny_dir):
    return ctl.configure(tiny_config(tiny_dir))


def _cli(*args, env_extra=None, cwd=REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "mgpu_backend", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


# ---- the private socket ---------------------------------------------------------------------------------------------

def test_runtime_dir_socket_and_key_are_private(ctl, runtime):
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(runtime / SOCKET_NAME).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(runtime / SOCKET_NAME).st_mode)
    assert stat.S_IMODE(os.stat(runtime / KEY_NAME).st_mode) == 0o600
    assert len((runtime / KEY_NAME).read_bytes()) == 32


def test_wrong_auth_key_is_refused_and_controller_keeps_serving(ctl, runtime):
    pid = ctl.ping().pid
    wrong = bytes(b ^ 0xFF for b in (runtime / KEY_NAME).read_bytes())
    for _ in range(2):
        with pytest.raises(AuthenticationError):
            Client(str(runtime / SOCKET_NAME), family="AF_UNIX", authkey=wrong)
    assert ctl.ping().pid == pid
    assert ControllerClient(runtime, start=False).ping().pid == pid


# ---- reattaching, busy, stale handles -------------------------------------------------------------------------------

def test_second_client_reattaches_to_the_same_controller_and_fleet(ctl, handle, runtime):
    first = ctl.status()
    other = ControllerClient(runtime_dir=runtime)  # start=True, but one answers: nothing is started
    try:
        assert other.started_pid is None
        second = other.status()
        assert second.pid == first.pid == ctl.ping().pid
        assert second.fleet.generation == first.fleet.generation == handle.generation
        assert second.fleet.worker_pids == handle.worker_pids
        # the same configuration from the second client reuses the fleet
        again = other.configure(handle.config)
        assert again.generation == handle.generation and again.worker_pids == handle.worker_pids
        out = other.run(again, JobSpec("noop", NoopRequest(steps=1)))
        assert torch.equal(out.tensor, torch.arange(4, dtype=torch.float32))
    finally:
        other.close()


def test_busy_is_answered_at_once_and_cancel_keeps_the_fleet(ctl, handle, runtime):
    job = JobSpec("noop", NoopRequest(steps=400, sleep_s=0.05))  # ~20 s unless cancelled
    started, outcome = threading.Event(), {}

    def first():
        try:
            ctl.run(handle, job, on_event=lambda e: started.set())
        except Exception as exc:  # noqa: BLE001 (handed to the main thread)
            outcome["error"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(60), "the first job did not start"
    other = ControllerClient(runtime, start=False)
    try:
        with pytest.raises(FleetBusy) as info:
            other.run(handle, JobSpec("noop", NoopRequest(steps=1)))
        assert f"busy with a noop job ({job.job_id})" in str(info.value)
        assert thread.is_alive(), "FleetBusy came only after the running job ended"
        with pytest.raises(FleetBusy, match=f"busy with a noop job \\({job.job_id}\\); try again when it ends"):
            other.configure(handle.config)
        assert other.status().busy_job == job.job_id
        other.cancel(job.job_id)
    finally:
        other.close()
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), JobCancelled), outcome
    status = ctl.status()
    assert status.busy_job is None and status.fleet.worker_pids == handle.worker_pids


def test_unknown_job_kind_is_refused_and_fleet_kept(ctl, handle):
    with pytest.raises(ControllerError) as info:
        ctl.run(handle, JobSpec("no-such-kind", None))
    assert info.value.kind == "validation" and not info.value.fleet_lost
    assert "unknown job kind 'no-such-kind'" in str(info.value) and "noop" in str(info.value)
    assert ctl.status().fleet.worker_pids == handle.worker_pids


def test_frames_come_back_through_shared_memory(ctl, handle):
    before = set(os.listdir("/dev/shm"))
    out = ctl.run(handle, JobSpec("frames", FramesRequest((5, 32, 48, 3))))
    frames = out.frames
    assert frames.shape == (5, 32, 48, 3) and frames.dtype == torch.float32
    expected = torch.arange(5, dtype=torch.float32).div(5).view(5, 1, 1, 1).expand(5, 32, 48, 3)
    assert torch.equal(frames, expected)
    assert set(os.listdir("/dev/shm")) - before == set(), "the shared-memory block was not freed"


def test_fault_injection_is_ignored_without_the_test_switch(ctl, handle):
    """This controller runs without LTX2_MGPU_TEST_FAULTS=1: a job's `fault` is dropped, the job runs."""
    fault = FaultSpec(rank=0, stage="noop", step=0, kind="crash")
    out = ctl.run(handle, JobSpec("noop", NoopRequest(steps=2), fault=fault))
    assert torch.equal(out.tensor, torch.arange(4, dtype=torch.float32))
    assert ctl.status().fleet.worker_pids == handle.worker_pids


def test_cli_status_shows_the_fleet(ctl, handle, runtime):
    result = _cli("status", env_extra={"LTX2_MGPU_RUNTIME_DIR": str(runtime)})
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["pid"] == ctl.ping().pid
    assert status["fleet"]["generation"] == handle.generation
    assert status["fleet"]["worker_pids"] == list(handle.worker_pids)
    assert status["fleet"]["open_counts"] == [2]  # checkpoint + upscaler, opened once


def test_policy_change_keeps_the_fleet(ctl, handle, tiny_dir):
    """A configuration that differs in policy only (SP degree, guidance-parallel mode, token minimum and cap,
    timeouts, compile) is served by the running fleet: same generation, same worker PIDs, no file opened again; the
    old handle and the new one both run jobs (each under its own policy). A policy the checkpoint cannot take (a
    degree above the ranks) is refused before anything changes."""
    policy = dict(sp_degree=1, guidance_parallel="off", min_tokens_per_rank=0, token_cap=4096, stall_timeout_s=61.0,
                  init_timeout_s=90.0, compile=True)
    configured = ctl.configure_fleet(tiny_config(tiny_dir, **policy))
    new = configured.handle
    assert new.config.identity == handle.config.identity and new.config.policy != handle.config.policy
    assert handle.plan == FleetPlan(1, 8, 1, (1,)) and new.plan == FleetPlan(1, 8, 1, (1,), set_by_policy=True)
    # where the worker placed the weights (weights="auto", a CPU rank: no budget, every unit whole)
    placement = handle.plan.placement
    assert (placement.requested, placement.mode, placement.units, placement.budget_bytes) == ("auto", "replicated", 4,
                                                                                              None)
    assert (new.generation, new.worker_pids) == (handle.generation, handle.worker_pids)
    assert configured.replaced is None
    for h in (new, handle):
        out = ctl.run(h, JobSpec("noop", NoopRequest(steps=1)))
        assert torch.equal(out.tensor, torch.arange(4, dtype=torch.float32))
    status = ctl.status().fleet
    assert status.worker_pids == handle.worker_pids and status.generation == handle.generation
    assert status.open_counts == (2,)  # checkpoint + upscaler, opened once at start
    assert status.policy == handle.config.policy  # the last job ran under the first handle's policy
    with pytest.raises(ControllerError, match="degree 2 is not possible") as info:
        ctl.configure(tiny_config(tiny_dir, sp_degree=2))
    assert info.value.kind == "validation" and info.value.kind is ErrorKind.VALIDATION
    assert ctl.status().fleet.worker_pids == handle.worker_pids
    assert ctl.status().fleet.plan == FleetPlan(world_size=1, heads=8, sp_degree=1, valid_degrees=(1,),
                                                set_by_policy=False, sequence_parallel=True)


def test_the_plan_in_the_handle_follows_the_fleets_heads_and_the_policy():
    """`Fleet.plan_for`: the degree rule (`protocol/fleet_rules.py`) applied to the heads the workers reported — what
    Load Checkpoint (MGPU) shows. 8 heads on 3 ranks: degree 2 (3 does not divide 8); an explicit degree is the
    policy's; a fleet without a parallel plan runs every stage whole."""
    from types import SimpleNamespace

    from mgpu_backend.serving.fleet import Fleet

    fleet = SimpleNamespace(heads=8, world_size=3, identity=SimpleNamespace(sequence_parallel=True))
    assert Fleet.plan_for(fleet, FleetPolicy()) == FleetPlan(3, 8, 2, (1, 2))
    assert Fleet.plan_for(fleet, FleetPolicy(sp_degree=1)) == FleetPlan(3, 8, 1, (1, 2), set_by_policy=True)
    whole = SimpleNamespace(heads=8, world_size=3, identity=SimpleNamespace(sequence_parallel=False))
    assert Fleet.plan_for(whole, FleetPolicy()) == FleetPlan(3, 8, 1, (1,), sequence_parallel=False)


def test_error_kinds_keep_their_wire_values():
    """`ErrorKind` is a str enum: a member equals, hashes and prints as the string the nodes and clients compare with, and a
    `ControllerError` built from a wire string has the member; an unknown kind (another controller version's) keeps
    the message: the generic kind, the original named in `details.kind`."""
    assert ErrorKind.STALE_HANDLE == "stale_handle" and f"{ErrorKind.BUSY}" == "busy" == str(ErrorKind.BUSY)
    assert "busy" in {ErrorKind.BUSY} and {"validation": 1}[ErrorKind.VALIDATION] == 1
    assert {k.value for k in ErrorKind} == {"validation", "job_error", "cancelled", "busy", "stale_handle",
                                               "fleet_lost", "fleet_stopped", "protocol", "start_failed",
                                               "not_running", "controller_lost", "error"}
    exc = ControllerError("x", kind="cancelled")
    assert exc.kind is ErrorKind.CANCELLED and ControllerError("y").kind is ErrorKind.ERROR
    odd = ControllerError("out of memory on rank 1", kind="out_of_memory", details=ErrorDetails(rank=1))
    assert str(odd) == "out of memory on rank 1" and odd.kind is ErrorKind.ERROR
    assert odd.details == ErrorDetails(rank=1, kind="out_of_memory")
    # a dict (an older controller's JobError): its known keys, the others dropped
    old = ControllerError("boom", kind="job_error", details={"stage": "stage 1", "step": 3, "extra": 1})
    assert old.details == ErrorDetails(stage="stage 1", step=3) and ControllerError("z").details == ErrorDetails()


def test_a_controller_dying_during_the_handshake_is_no_controller(tmp_path):
    """A listener that accepts and closes before the authentication challenge (a controller SIGKILLed while a client
    connects: the soak through ComfyUI met it as a raw ConnectionResetError in SP Sampler) is "no controller
    answers" — with start=True the client starts a new one — not an error from inside multiprocessing."""
    import socket

    runtime = ensure_private_dir(tmp_path / "rt")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(runtime / SOCKET_NAME))
    listener.listen(4)

    def accept_and_close():
        conn, _ = listener.accept()
        conn.close()

    t = threading.Thread(target=accept_and_close, daemon=True)
    t.start()
    try:
        with pytest.raises(ControllerError, match="no controller answers") as info:
            ControllerClient(runtime, start=False)
        assert info.value.kind == ErrorKind.NOT_RUNNING
        t.join(5)
    finally:
        listener.close()


def test_the_controller_validates_a_checkpoint_without_diffusers(tiny_dir):
    """`check_config` (the controller's validation before any worker starts) reads the safetensors header and applies
    the degree rule: in a fresh process it refuses a bad degree and accepts a good one without importing diffusers
    (nor transformers)."""
    files = tiny_dir["2.0"]
    code = textwrap.dedent(f"""
        import sys
        from mgpu_backend.serving.controller import check_config
        from mgpu_backend.protocol.errors import ControllerError
        from mgpu_backend.protocol.fleet_config import FleetConfig
        config = dict(devices=("cpu",) * 4, checkpoint={str(files["checkpoint"])!r}, gemma=None)
        try:
            check_config(FleetConfig(**config, sp_degree=3))
        except ControllerError as exc:
            assert exc.kind == "validation" and "valid degrees: 1, 2, 4" in str(exc), exc
        else:
            raise AssertionError("degree 3 was accepted")
        check_config(FleetConfig(**config, sp_degree=2))
        loaded = sorted(m for m in ("diffusers", "transformers") if m in sys.modules)
        assert not loaded, loaded
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_policy_fields_are_checked_on_construction(tiny_dir):
    """Each half validates itself: a bad policy or identity value is refused by name before any request is sent."""
    with pytest.raises(ValueError, match="guidance_parallel='sometimes'"):
        tiny_config(tiny_dir, guidance_parallel="sometimes")
    with pytest.raises(ValueError, match="stall_timeout_s=0"):
        tiny_config(tiny_dir, stall_timeout_s=0)
    with pytest.raises(ValueError, match="dtype='float8'"):
        tiny_config(tiny_dir, dtype="float8")
    with pytest.raises(ValueError, match="gemma_mode='split'"):
        FleetIdentity(devices=("cpu",), checkpoint="c.safetensors", gemma=None, gemma_mode="split")
    with pytest.raises(ValueError, match="sp_degree=0"):
        FleetPolicy(sp_degree=0)


def test_a_config_is_its_identity_and_its_policy():
    """`FleetConfig` declares no field of its own: keywords go to the part that declares them, a field reads from
    its part, and `dataclasses.replace` changes one part; an unknown keyword or a part of another type is refused."""
    identity = FleetIdentity(devices=("cpu", "cpu"), checkpoint="c.safetensors", gemma=None, dtype="bfloat16")
    policy = FleetPolicy(sp_degree=2, compile=True)
    config = FleetConfig(devices=("cpu", "cpu"), checkpoint="c.safetensors", gemma=None, dtype="bfloat16",
                         sp_degree=2, compile=True)
    assert config == FleetConfig(identity, policy) and config.identity == identity and config.policy == policy
    assert (config.devices, config.dtype, config.sp_degree, config.compile, config.world_size) == (
        ("cpu", "cpu"), "bfloat16", 2, True, 2)
    assert [f.name for f in dataclasses.fields(FleetConfig)] == ["identity", "policy"]
    assert FleetConfig(identity).policy == FleetPolicy()
    changed = dataclasses.replace(config, gemma="g.safetensors", token_cap=None)
    assert changed.identity == dataclasses.replace(identity, gemma="g.safetensors")
    assert changed.policy == dataclasses.replace(policy, token_cap=None)
    with pytest.raises(TypeError, match="unknown field.* speed"):
        FleetConfig(identity, speed=2)
    with pytest.raises(TypeError, match="policy=dict: must be a FleetPolicy"):
        FleetConfig(identity, {"sp_degree": 2})
    with pytest.raises(AttributeError, match="speed"):
        config.speed  # noqa: B018


def test_stale_handle_is_refused(ctl, handle, tiny_dir):
    """A handle from before a rebuild with another identity (here the threads per worker) is refused, saying so;
    the new handle works."""
    other_config = tiny_config(tiny_dir, threads_per_worker=2)
    assert other_config.identity != handle.config.identity
    new = ctl.configure(other_config)
    assert new.generation > handle.generation
    assert not set(new.worker_pids) & set(handle.worker_pids)
    with pytest.raises(ControllerError) as info:
        ctl.run(handle, JobSpec("noop", NoopRequest(steps=1)))
    message = str(info.value)
    assert info.value.kind == "stale_handle" and not info.value.fleet_lost
    assert f"generation {handle.generation} is stale" in message and "another configuration" in message
    out = ctl.run(new, JobSpec("noop", NoopRequest(steps=1)))
    assert torch.equal(out.tensor, torch.arange(4, dtype=torch.float32))
    assert ctl.status().fleet.generation == new.generation  # the refused handle rebuilt nothing


# ---- controllers of their own ---------------------------------------------------------------------------------------

def test_cli_policy_change_runs_on_the_same_fleet(tiny_dir, tmp_path):
    """Two `generate` runs with different `--sp-degree` / `--guidance-parallel` on a 2-rank CPU fleet: the second
    runs on the first's workers (same generation and PIDs, each rank's checkpoint opened once) under its own
    policy, which its report shows."""
    runtime = short_runtime_dir()
    env = {"LTX2_MGPU_RUNTIME_DIR": str(runtime)}
    files = tiny_dir["2.0"]
    base = ["generate", "--checkpoint", str(files["checkpoint"]), "--gemma", str(files["gemma"]), "--upscaler",
            str(files["upsampler"]), "--prompt", "a fox", "--width", "128", "--height", "128", "--frames", "9",
            "--steps", "1", "--devices", "cpu:2"]
    try:
        seen = []
        for i, policy in enumerate((["--sp-degree", "2", "--guidance-parallel", "off"],
                                    ["--sp-degree", "1", "--guidance-parallel", "on"])):
            run = _cli(*base, *policy, "--output", str(tmp_path / f"clip{i}.mp4"), env_extra=env)
            assert run.returncode == 0, run.stderr
            status = _cli("status", env_extra=env)
            assert status.returncode == 0, status.stderr
            fleet = json.loads(status.stdout)["fleet"]
            seen.append((fleet["generation"], fleet["worker_pids"], fleet["open_counts"],
                         fleet["policy"]["sp_degree"], fleet["policy"]["guidance_parallel"], run.stdout))
        (gen1, pids1, opens1, sp1, gp1, out1), (gen2, pids2, opens2, sp2, gp2, out2) = seen
        assert (gen2, pids2, opens2) == (gen1, pids1, opens1) and len(pids1) == 2
        assert (sp1, gp1, sp2, gp2) == (2, "off", 1, "on")
        assert "replaced" not in out2
        assert "guidance passes in parallel" not in out1 and "sequence parallel" in out1
        assert "stage 1: guidance passes in parallel on 2 ranks" in out2 and "guidance_parallel='on'" in out2
    finally:
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def test_cli_waits_for_another_clients_job_then_runs(tiny_dir, tmp_path):
    """A CLI `generate` while another client's job runs: `--busy-wait 0` fails at once naming that job (exit 2);
    the default waits (saying so on stderr), then configures and runs once the other job has ended."""
    runtime = short_runtime_dir()
    env = {"LTX2_MGPU_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(REPO)}
    files = tiny_dir["2.0"]
    base = ["generate", "--checkpoint", str(files["checkpoint"]), "--gemma", str(files["gemma"]), "--upscaler",
            str(files["upsampler"]), "--prompt", "a fox", "--width", "128", "--height", "128", "--frames", "9",
            "--steps", "1", "--devices", "cpu:1"]
    other = ControllerClient(runtime_dir=runtime)
    job = JobSpec("noop", NoopRequest(steps=2400, sleep_s=0.05))  # ~2 min unless cancelled
    started, outcome = threading.Event(), {}

    def first():
        try:
            other.run(other.configure(tiny_config(tiny_dir)), job, on_event=lambda e: started.set())
        except Exception as exc:  # noqa: BLE001 (handed to the main thread)
            outcome["error"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert started.wait(60), "the other client's job did not start"
        at_once = _cli(*base, "--busy-wait", "0", "--output", str(tmp_path / "no.mp4"), env_extra=env)
        assert at_once.returncode == 2, at_once.stderr
        assert f"busy with a noop job ({job.job_id})" in at_once.stderr and "waiting" not in at_once.stderr
        assert not (tmp_path / "no.mp4").exists()
        waiting = subprocess.Popen([sys.executable, "-m", "mgpu_backend", *base, "--output", str(tmp_path / "a.mp4")],
                                   cwd=REPO, env={**os.environ, **env}, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
        lines = []
        while not any(line.startswith("note: the fleet is busy") for line in lines):  # before any progress bar
            lines.append(waiting.stderr.readline())
            assert lines[-1], f"the CLI ended without waiting: {lines}"
        assert f"busy with a noop job ({job.job_id})" in lines[-1] and "waiting up to 3600 s" in lines[-1], lines
        assert waiting.poll() is None
        ControllerClient(runtime, start=False).cancel(job.job_id)
        out, err = waiting.communicate(timeout=240)
        assert waiting.returncode == 0, err
        assert (tmp_path / "a.mp4").stat().st_size > 0
        thread.join(60)
        assert isinstance(outcome.get("error"), JobCancelled), outcome
    finally:
        other.close()
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


def test_cli_stop_stops_controller_and_workers():
    runtime = short_runtime_dir()
    env = {"LTX2_MGPU_RUNTIME_DIR": str(runtime)}
    try:
        assert _cli("status", env_extra=env).stdout.strip() == "no controller is running"
        client = ControllerClient(runtime_dir=runtime)
        pid = client.ping().pid
        client.close()
        result = _cli("stop", env_extra=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "controller stopped; no fleet was loaded", result.stdout
        assert wait_gone([pid]), "the controller still runs after stop"
        assert not (runtime / SOCKET_NAME).exists()
        assert _cli("status", env_extra=env).stdout.strip() == "no controller is running"
    finally:
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


MANGLED_CLIENT = textwrap.dedent("""
    import importlib, importlib.util, json, sys
    repo, runtime, config_json = sys.argv[1], sys.argv[2], sys.argv[3]
    assert not any(p and repo.rstrip("/") == p.rstrip("/") for p in sys.path), sys.path
    # what ComfyUI does with a custom node folder: import its __init__ under a name of its own
    name = "custom_nodes_ltx2_multigpu_0x5f3a"
    spec = importlib.util.spec_from_file_location(name, repo + "/__init__.py", submodule_search_locations=[repo])
    pack = importlib.util.module_from_spec(spec)
    sys.modules[name] = pack
    spec.loader.exec_module(pack)
    client_mod = importlib.import_module(name + ".mgpu_backend.serving.client")
    fleet_config = importlib.import_module(name + ".mgpu_backend.protocol.fleet_config")
    job_requests = importlib.import_module(name + ".mgpu_backend.protocol.job_requests")
    client = client_mod.ControllerClient(runtime_dir=runtime)
    fields = json.loads(config_json)
    fields["devices"] = tuple(fields["devices"])
    handle = client.configure(fleet_config.FleetConfig(**fields))
    out = client.run(handle, job_requests.JobSpec("noop", job_requests.NoopRequest(steps=1)))
    print(json.dumps({"started_pid": client.started_pid, "pid": client.ping().pid,
                      "generation": handle.generation, "handle_class": type(handle).__module__,
                      "tensor": out.tensor.tolist(), "plain_import": "mgpu_backend" in sys.modules}))
""")


def _editable_install() -> bool:
    """True when `mgpu_backend` is importable without the repo on sys.path (a pip install, editable or not)."""
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('mgpu_backend') "
                            "is not None)"], cwd="/", capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return probe.stdout.strip() == "True"


def test_controller_starts_outside_the_repo_from_a_mangled_import(tiny_dir, tmp_path):
    """ComfyUI imports the pack under a mangled module name, from its own working directory, without the repo on
    sys.path: the controller still starts (explicit PYTHONPATH), and objects cross the socket both ways."""
    runtime = short_runtime_dir()
    elsewhere = tmp_path / "comfyui-cwd"
    elsewhere.mkdir()
    config = tiny_config(tiny_dir)
    config_json = json.dumps({**dataclasses.asdict(config.identity), **dataclasses.asdict(config.policy),
                              "devices": list(config.devices)})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LTX2_MGPU_RUNTIME_DIR")}
    try:
        result = subprocess.run([sys.executable, "-c", MANGLED_CLIENT, str(REPO), str(runtime), config_json],
                                cwd=elsewhere, env=env, capture_output=True, text=True, timeout=150)
        assert result.returncode == 0, result.stderr[-3000:]
        info = json.loads(result.stdout.strip().splitlines()[-1])
        assert info["started_pid"] == info["pid"]
        # objects come back under the caller's (mangled) module name, even where the plain package is importable
        # too (CI installs it editable): two copies of one class would break the caller's isinstance checks
        assert info["handle_class"] == "custom_nodes_ltx2_multigpu_0x5f3a.mgpu_backend.protocol.fleet_config"
        if not _editable_install():
            assert info["plain_import"] is False
        assert info["tensor"] == [0.0, 1.0, 2.0, 3.0]
        pid = info["pid"]
        assert os.readlink(f"/proc/{pid}/cwd") == str(runtime)  # not the repo, not the caller's folder
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        # its import path: the private root that links this repo's mgpu_backend alone (never the pack folder)
        root = Path(environ[b"PYTHONPATH"].decode().split(os.pathsep)[0])
        assert root == runtime / "pythonpath"
        assert (root / "mgpu_backend").resolve() == REPO / "mgpu_backend"
        # this (plainly imported) client reattaches to it and sees the fleet the mangled client made
        client = ControllerClient(runtime, start=False)
        assert client.status().fleet.generation == info["generation"]
    finally:
        stop_controller(runtime)
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.mark.parametrize("shm_dir", ["/dev/shm", "/nonexistent-shm-dir"])
@pytest.mark.parametrize("shape", [(3, 8, 12, 3), (0, 8, 12, 3)])
def test_frame_hand_back_round_trip(monkeypatch, shm_dir, shape):
    """`send_frames` -> `receive_frames` gives the same values in ordinary (writable) memory and frees the block —
    through a /dev/shm file (Linux) and through `SharedMemory` where that directory does not exist."""
    from mgpu_backend.protocol import frames as F

    monkeypatch.setattr(F, "SHM_DIR", shm_dir)
    before = set(os.listdir("/dev/shm"))
    frames = torch.rand(shape)
    ref = F.send_frames(frames)
    assert ref.shape == shape and ref.dtype == "float32"
    out = F.receive_frames(DecodeResult(ref, None))
    assert torch.equal(out.frames, frames) and out.audio is None
    out.frames.add_(1.0)  # a private copy: writable, not a view of the freed block
    assert set(os.listdir("/dev/shm")) - before == set(), "the shared-memory block was not freed"
