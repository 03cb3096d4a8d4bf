"""What the ComfyUI nodes and the CLI call: find (or start) the controller, configure a fleet, run jobs.

The controller is started with the caller's `sys.executable` and an explicit PYTHONPATH to the directory holding
this package (ComfyUI imports the pack under a mangled module name, so nothing relies on how the caller imported
it), in a new session so that it survives the caller. A later client (e.g. after a ComfyUI restart) reattaches.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Client as _Connect
from pathlib import Path
from typing import Any

import torch

from ..protocol import frames as F
from ..protocol import shm_lane
from ..protocol.errors import ControllerError, ErrorKind, FleetBusy, JobCancelled
from ..protocol.fleet_config import FleetConfig, FleetHandle
from ..protocol.job_requests import JobSpec
from ..protocol.job_results import ControllerStatus, FleetTeardown
from ..protocol.messages import Accepted, Busy, Cancel, Configure, Configured, JobError, JobResult, Ping, Pong, Progress, Refused, Reply, Request, ShutdownFleet, Status, Stop, Submit
from ..protocol.transport import INLINE_JOBS, Pickled, SOCKET_NAME, default_runtime_dir, ensure_private_dir, read_or_create_key, recv, send, wire_job
from ..protocol.resources import Host, check_rank_count, check_rank_total, cpu_cores, peer_pid

PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the directory that holds `mgpu_backend` (this file: mgpu_backend/serving/client.py)
START_TIMEOUT_S = 60.0


def parse_devices(devices: str | int | None = "all", world_size: int | None = None) -> tuple[str, ...]:
    """`"all"`, a count (`2`, `"2"`), a CUDA index list (`"0,1,3"`, or `"1,"` for one index) or `"cpu"` /
    `"cpu:N"` -> one device per rank.

    Without CUDA, "all" and counts give CPU ranks (gloo). `world_size` caps / sets the count.
    Raises ValueError naming the value and the rule; FleetTooLarge (a ValueError) for more ranks than this host runs
    (`resources.check_rank_count`: GPUs present, CPU cores, `MAX_RANKS`), before any process starts; a count is
    held to `MAX_RANKS` before the device tuple is built (`resources.check_rank_total`), so "3000000000" is refused
    at once, not after building billions of entries.
    """
    spec = str(devices if devices is not None else "all").strip().lower()
    cuda = torch.cuda.device_count()
    what = f"devices={devices!r}" + (f", world_size={world_size}" if world_size is not None else "")

    def bounded(count: int) -> int:  # MAX_RANKS before a tuple of `count` entries is built (issue 36)
        check_rank_total(count, what, Host(cpu_cores(), cuda, None))
        return count

    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size={world_size}: need at least one rank")
    if spec.startswith("cpu"):
        count_text = spec.split(":", 1)[1] if ":" in spec else str(world_size or 1)
        if not count_text.isdigit() or int(count_text) < 1:
            raise ValueError(f"devices={devices!r}: 'cpu:N' needs a positive rank count N")
        out = ("cpu",) * bounded(int(count_text))
    elif "," in spec:  # an index list ("0,1,3"; a single index is written "1,")
        indices = [int(s) for s in spec.split(",") if s.strip()]
        if len(set(indices)) != len(indices):
            raise ValueError(f"devices={devices!r}: a device index appears twice")
        bad = [i for i in indices if i >= cuda or i < 0]
        if bad:
            raise ValueError(f"devices={devices!r}: CUDA device(s) {bad} do not exist (this machine has {cuda})")
        out = tuple(f"cuda:{i}" for i in indices)
    else:
        if spec == "all":
            count = world_size or (cuda if cuda else 1)
        elif spec.isdigit():
            count = int(spec)
        else:
            raise ValueError(f"devices={devices!r}: use 'all', a count, a CUDA index list like '0,1,3' (one index: "
                             f"'1,'), or 'cpu:N'")
        if count < 1:
            raise ValueError(f"devices={devices!r}: a count of 0 devices; a plain number is a count (the first N "
                             f"GPUs): for GPU 0 alone write '0,' (an index list) or '1'")
        if cuda:
            if count > cuda:
                raise ValueError(f"devices={devices!r}: asked for {count} GPUs, this machine has {cuda}")
            out = tuple(f"cuda:{i}" for i in range(count))
        else:
            out = ("cpu",) * bounded(count)
    if world_size is not None and world_size != len(out):
        if world_size > len(out):
            raise ValueError(f"world_size={world_size} is larger than the {len(out)} devices given ({devices!r})")
        out = out[:world_size]
    check_rank_count(out, 1, Host(cpu_cores(), cuda, None), what=what)
    return out


def import_root(runtime_dir: Path) -> Path:
    """A private directory that holds only a link to this package: the controller's and workers' PYTHONPATH.

    The directory holding `mgpu_backend` is, in a ComfyUI install, the pack folder, whose other top-level folders
    (`kernels/`, `nodes/`, `tests/`) would shadow installed packages of the same import name in the fleet's
    processes — `kernels` is Hugging Face's kernel loader, which diffusers imports. Off POSIX (no symlinks) it is the
    parent directory itself.
    """
    if os.name != "posix":
        return PACKAGE_PARENT
    root = ensure_private_dir(runtime_dir / "pythonpath")
    link = root / "mgpu_backend"
    target = PACKAGE_PARENT / "mgpu_backend"
    if not (link.is_symlink() and Path(os.readlink(link)) == target):
        tmp = root / f".mgpu_backend.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a controller starting beside us never sees a missing link
    return root


def controller_env(runtime_dir: Path) -> dict[str, str]:
    """The controller's environment (its workers inherit it): this process's, with PYTHONPATH = the import root
    first, then the caller's own entries except the pack folder itself (see `import_root`)."""
    env = dict(os.environ)
    inherited = [e for e in env.get("PYTHONPATH", "").split(os.pathsep)
                 if e and Path(e).resolve() != PACKAGE_PARENT]
    env["PYTHONPATH"] = os.pathsep.join([str(import_root(runtime_dir))] + inherited)
    return env


def _launch(runtime_dir: Path, log_path: Path) -> subprocess.Popen:
    env = controller_env(runtime_dir)
    log = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    return subprocess.Popen([sys.executable, "-m", "mgpu_backend.serving.controller", "--runtime-dir", str(runtime_dir)],
                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=str(runtime_dir))


class ControllerClient:
    """A connection to the controller. `connect()` starts one when none answers.

    Methods raise ControllerError (or its subclasses FleetBusy, JobCancelled) with the controller's message; a
    controller that goes away during a request or a job (killed, crashed) raises ControllerError of kind
    "controller_lost" naming what it was doing and what to do (`_lost`), never a bare EOFError.
    `shm_lane`: the large tensors of the `INLINE_JOBS` ride in a shared-memory lane of this process
    (`protocol/shm_lane.py`; default: on where /dev/shm exists, unless LTX2_MGPU_SHM_LANE=0); False: by value.
    """

    def __init__(self, runtime_dir: Path | None = None, start: bool = True, shm_lane: bool | None = None):
        self.runtime_dir = ensure_private_dir(Path(runtime_dir) if runtime_dir else default_runtime_dir())
        self.socket_path = self.runtime_dir / SOCKET_NAME
        self.key = read_or_create_key(self.runtime_dir)
        self.started_pid: int | None = None
        self.controller_pid: int | None = None  # the peer of the connection (SO_PEERCRED), for a lost controller
        self.shm_lane = _lanes_default() if shm_lane is None else bool(shm_lane)
        self._handshake_lost: BaseException | None = None
        self._conn = self._connect(start)
        self.controller_pid = peer_pid(self._conn)

    def _try_connect(self):
        """A connection to the controller, or None where none answers: no socket, a stale one (refused), or a
        controller that died during the handshake (reset, or closed before or after the challenge: it was SIGKILLed
        or is stopping; kept in `_handshake_lost` for the error)."""
        try:
            return _Connect(str(self.socket_path), family="AF_UNIX", authkey=self.key)
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        except (ConnectionError, EOFError) as exc:
            self._handshake_lost = exc
            return None

    def _connect(self, start: bool):
        conn = self._try_connect()
        if conn is not None or not start:
            if conn is None:
                lost = self._handshake_lost
                why = (f": the controller went away during the connection's handshake ({_what(lost)}) — it was "
                       f"killed or is stopping; see {self.runtime_dir / 'controller.log'}" if lost is not None else "")
                raise ControllerError(f"no controller answers on {self.socket_path}{why}",
                                      kind=ErrorKind.NOT_RUNNING)
            return conn
        proc = _launch(self.runtime_dir, self.runtime_dir / "controller.log")
        self.started_pid = proc.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ControllerError(f"the controller exited with code {proc.returncode} at start; see "
                                      f"{self.runtime_dir / 'controller.log'}", kind=ErrorKind.START_FAILED)
            conn = self._try_connect()
            if conn is not None:
                return conn
            time.sleep(0.1)
        proc.kill()  # it never listened: not left running behind the error
        proc.wait(5)
        raise ControllerError(f"the controller (pid {proc.pid}) did not answer within {START_TIMEOUT_S:g} s and was "
                              f"killed; see {self.runtime_dir / 'controller.log'}", kind=ErrorKind.START_FAILED)

    def close(self) -> None:
        self._conn.close()

    def _lost(self, during: str, exc: BaseException) -> ControllerError:
        """The error for a controller that went away (the connection closed or reset) while it was `during` what
        this client asked: it names the controller, the moment and what to do (kind "controller_lost", fleet_lost:
        its workers end with it, `serving/worker_start.py`)."""
        pid = f" (pid {self.controller_pid})" if self.controller_pid else ""
        return ControllerError(
            f"lost the multi-GPU controller{pid} while {during}: the connection closed ({_what(exc)}), so it was killed or crashed (the "
            f"out-of-memory killer, a kill -9, a crash) and its workers end with it; run it again: the next request "
            f"starts a new controller (why this one ended: {self.runtime_dir / 'controller.log'}, and `dmesg` for the "
            f"out-of-memory killer)", kind=ErrorKind.CONTROLLER_LOST, fleet_lost=True)

    def request(self, message: Request) -> Reply:
        """Send one request (not `Submit`: `run`) and read its reply. Raises FleetBusy / ControllerError when the
        controller refuses it (`Refused`), ControllerError (kind "controller_lost") when it goes away before it
        answers."""
        try:
            send(self._conn, message)
            reply = recv(self._conn)
        except (EOFError, OSError) as exc:
            raise self._lost(_during(message), exc) from None
        if isinstance(reply, Refused):
            cls = FleetBusy if reply.kind == ErrorKind.BUSY else ControllerError
            raise cls(reply.message, kind=reply.kind)
        if not isinstance(reply, Reply):
            raise self._unexpected(reply)
        return reply

    def _unexpected(self, message) -> ControllerError:
        """The error for a message that is not of `protocol.messages`: a dict is the answer of a controller started
        by an older version of the pack (its requests were dicts), still running."""
        older = (" — a controller started by an older version of the pack answers there: stop that process (`python "
                 f"-m mgpu_backend.serving.controller --runtime-dir {self.runtime_dir}`) and retry" if isinstance(message, dict)
                 else "")
        return ControllerError(f"unexpected message from the controller on {self.socket_path}: "
                               f"{type(message).__name__}{older}", kind=ErrorKind.PROTOCOL)

    def _older(self, what: str, pid: int | None = None) -> ControllerError:
        """The error for a dict where this version's typed answer is expected (a job's result, the status): a
        controller started by an older version of the pack (its results were dicts) answers on this socket."""
        which = f"pid {pid}: " if pid else ""
        return ControllerError(f"the controller on {self.socket_path} answered with a dict for {what} — a controller "
                               f"started by an older version of the pack answers there: stop that process ({which}"
                               f"`python -m mgpu_backend.serving.controller --runtime-dir {self.runtime_dir}`) and retry",
                               kind=ErrorKind.PROTOCOL)

    def ping(self) -> Pong:
        return self.request(Ping())

    def _pid(self) -> int | None:
        """The controller's pid, for an error naming it (None: it does not answer)."""
        try:
            return self.request(Ping()).pid
        except (ControllerError, OSError, EOFError, AttributeError):
            return None

    def status(self) -> ControllerStatus:
        """The controller's and the fleet's state (`messages.StatusReply.status`). Raises ControllerError naming the
        process to stop when an older controller answers (its status, or its fleet or processes in it, are dicts)."""
        status = self.request(Status()).status
        if isinstance(status, dict):
            raise self._older("the status", status.get("pid"))
        if isinstance(status.fleet, dict) or any(isinstance(p, dict) for p in status.processes):
            raise self._older("the status's fleet and processes", status.pid)
        return status

    def configure(self, config: FleetConfig) -> FleetHandle:
        """The fleet for `config` (reused when unchanged): `configure_fleet(config).handle`."""
        return self.configure_fleet(config).handle

    def configure_fleet(self, config: FleetConfig) -> Configured:
        """The fleet for `config` (reused when unchanged): the controller's `Configured` reply, its handle and what a
        rebuild replaced (`FleetTeardown`: the old fleet and the other clients connected; None when the fleet was
        kept or none ran). Raises ControllerError naming the process to stop when an older controller answers (what
        it replaced is a dict)."""
        reply: Configured = self.request(Configure(config))
        if isinstance(reply.replaced, dict):
            raise self._older("what the configure replaced", self._pid())
        return reply

    def shutdown_fleet(self) -> FleetTeardown:
        """Stop the fleet (the controller stays). Returns what was stopped. Raises ControllerError naming the process
        to stop when an older controller answers (what it stopped is a dict; its fleet is stopped)."""
        stopped = self.request(ShutdownFleet()).stopped
        if isinstance(stopped, dict):
            raise self._older("what the shutdown_fleet stopped", self._pid())
        return stopped

    def stop(self) -> FleetTeardown:
        """Stop the controller and its fleet. Returns what was stopped. Raises ControllerError when an older
        controller answered (what it stopped is a dict): it has stopped all the same."""
        stopped = self.request(Stop()).stopped
        if isinstance(stopped, dict):
            raise ControllerError(f"the controller on {self.socket_path} answered the stop with a dict — it was "
                                  f"started by an older version of the pack; it has stopped, with its fleet (the "
                                  f"next client starts this version's controller)", kind=ErrorKind.PROTOCOL)
        return stopped

    def cancel(self, job_id: str) -> None:
        """Cancel from another connection (this one is busy streaming the job)."""
        other = ControllerClient(self.runtime_dir, start=False)
        try:
            other.request(Cancel(job_id))
        finally:
            other.close()

    def run(self, handle: FleetHandle, job: JobSpec, on_event: Callable[[Progress], None] | None = None,
            on_accepted: Callable[[Accepted], None] | None = None,
            cancel_requested: Callable[[], bool] | None = None, poll_s: float = 0.2) -> Any:
        """Submit a job and block until it ends, passing progress events to `on_event`.

        `cancel_requested()` is polled every `poll_s` while waiting (ComfyUI's interrupt flag); when it turns True
        the job is cancelled (all ranks stop at the next step boundary) and JobCancelled is raised.
        Returns the job's typed result (`protocol.job_results`, or the native MODEL's replies of `protocol/native_forward.py`) with
        shared-memory frames already copied into a tensor (and the block freed).
        Raises FleetBusy at once when another job runs; JobCancelled; ControllerError (also for a dict result: an
        older controller answers, the message names the process to stop).
        """
        args = (handle, on_event, on_accepted, cancel_requested, poll_s)
        lanes = shm_lane.client_lanes(str(self.runtime_dir)) if self.shm_lane and job.kind in INLINE_JOBS else None
        if lanes is None or not lanes.busy.acquire(blocking=False):  # another thread's job holds the lane
            return self._run(wire_job(job), None, *args)
        try:
            wired = wire_job(job, lanes)
            lane = lanes.lane if isinstance(wired.payload, Pickled) and wired.payload.lane is not None else None
            if lane is None:
                return self._run(wired, None, *args)
            try:
                return self._run(wired, lanes, *args)
            except FleetBusy:  # no rank saw the lane: a new one (still named) is dropped, not left named
                if lane.named:
                    lanes.drop()
                raise
            except ControllerError as exc:
                lane.unlink()  # every rank has mapped it (the controller unlinks it too)
                if exc.details.error_type != shm_lane.LaneMissing.__name__:
                    raise
                # a fleet started after the lane was made cannot map it: a new lane next time, this job by value
                lanes.drop()
                return self._run(wire_job(job), None, *args)
            except BaseException:  # the connection lost (a rank of the old fleet may live a moment longer), ^C
                lanes.drop()
                raise
        finally:
            lanes.busy.release()

    def _run(self, job: JobSpec, lanes, handle: FleetHandle, on_event, on_accepted, cancel_requested,
             poll_s: float) -> Any:
        """`run` of a job already wired (`transport.wire_job`); `lanes`: the `ClientLanes` its payload's lane is
        of, or None. Raises ControllerError (kind "controller_lost") when the controller goes away before the job's
        end, naming the job and its fleet."""
        accepted: list[Accepted] = []

        def during() -> str:
            if accepted:
                return f"job {job.job_id} ({job.kind}) ran on fleet generation {accepted[0].generation}"
            return f"it was taking job {job.job_id} ({job.kind}) (a fleet may have been starting for it)"

        try:
            return self._stream(job, lanes, handle, on_event, on_accepted, cancel_requested, poll_s, accepted)
        except (EOFError, OSError) as exc:
            raise self._lost(during(), exc) from None

    def _stream(self, job: JobSpec, lanes, handle: FleetHandle, on_event, on_accepted, cancel_requested,
                poll_s: float, accepted: list) -> Any:
        """Submit the job and read its events to the end (`_run`'s body; `accepted` gets the `Accepted` event)."""
        send(self._conn, Submit(handle, job))
        cancel_sent = False

        def maybe_cancel() -> bool:
            if cancel_sent or cancel_requested is None or not cancel_requested():
                return cancel_sent
            try:
                self.cancel(job.job_id)
                return True
            except ControllerError:  # not started yet: try again at the next check
                return False

        while True:
            # checked before every message too: with fast steps progress events never leave the poll idle
            cancel_sent = maybe_cancel()
            while cancel_requested is not None and not self._conn.poll(poll_s):
                cancel_sent = maybe_cancel()
            event = recv(self._conn)
            if isinstance(event, Busy):
                raise FleetBusy(f"the fleet is busy with {event.running}; try again when it is done",
                                kind=ErrorKind.BUSY)
            if isinstance(event, Accepted):
                accepted.append(event)
                if on_accepted:
                    on_accepted(event)
            elif isinstance(event, Progress):
                if on_event:
                    on_event(event)
            elif isinstance(event, JobResult):
                result = event.result
                if isinstance(result, Pickled):
                    if lanes is not None:
                        lanes.lane.unlink()  # every rank has mapped it (a no-op after its first job)
                        if result.lane_short:  # the reply did not fit in the reply region: a larger one next time
                            lanes.reply_bytes = max(lanes.reply_bytes, result.lane_short)
                    result = result.load()
                if isinstance(result, dict):
                    if isinstance(result.get("frames"), F.FramesRef):
                        F.unlink_shm(result["frames"].name)  # nobody else will read (and unlink) them
                    raise self._older(f"the result of job {job.job_id} ({job.kind})")
                return F.receive_frames(result)
            elif isinstance(event, JobError):
                cls = JobCancelled if event.kind == ErrorKind.CANCELLED else ControllerError
                raise cls(event.message, kind=event.kind, fleet_lost=event.fleet_lost, details=event.details)
            elif isinstance(event, Refused):
                raise ControllerError(event.message, kind=event.kind)
            else:
                raise self._unexpected(event)


def _lanes_default() -> bool:
    return shm_lane.enabled_by_default()


def _what(exc: BaseException) -> str:
    """"EOFError", "ConnectionResetError: [Errno 104] Connection reset by peer": an exception named in a message
    (an EOFError's own message is empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _during(message: Request) -> str:
    """What the controller was doing for `message` when it was lost, in the words of `ControllerClient._lost`."""
    if isinstance(message, Configure):
        config = message.config
        devices = getattr(config, "devices", ())
        return (f"it set up the fleet for this configuration ({len(devices)} rank(s) on {','.join(devices)}: "
                f"starting workers that load the model, or reusing the running ones)")
    if isinstance(message, (ShutdownFleet, Stop)):
        return f"it stopped {'the fleet' if isinstance(message, ShutdownFleet) else 'itself and its fleet'}"
    return f"it answered a {type(message).__name__} request"
