"""The background controller: holds the worker fleet, serves clients on a private Unix socket.

Started by `client.connect()` as `python -m mgpu_backend.serving.controller --runtime-dir DIR` with the caller's Python and
an explicit PYTHONPATH, in its own session (it outlives the ComfyUI process or CLI that started it, so a second
client reattaches). One controller per user serves every client — ComfyUI's nodes and the CLI alike.

One job at a time: a `submit` while a job runs is answered `busy` at once. A job is released (lock and current
job cleared) BEFORE its result or error is sent, so a client that submits again as soon as it has read the result
is never refused as busy with the job that just ended.

Every connection has its own thread, from the auth handshake on: the handshake has a deadline
(`protocol.transport.HANDSHAKE_TIMEOUT_S`), so a process that connects and never answers holds up nobody. A message
that cannot be read is answered with an error (`messages.Refused`, kind "protocol") and the controller keeps serving.
Requests, replies and a job's events are the frozen messages of `protocol/messages.py`.

The log (`controller.log` in the runtime directory) has one line per job (id, kind, client, seconds, outcome) and
one per fleet start or teardown (generation, devices, load seconds, why).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import struct
import threading
import time
from dataclasses import fields, replace
from multiprocessing.connection import AuthenticationError, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import TYPE_CHECKING

from ..protocol.errors import ControllerError, ErrorDetails, ErrorKind, FleetBusy, JobCancelled
from ..protocol.fleet_config import FleetConfig, FleetHandle, FleetPolicy
from ..protocol.job_requests import JobSpec
from ..protocol.job_results import ControllerStatus, FleetTeardown, ProcessInfo
from ..protocol.messages import Accepted, Busy, Cancel, Configure, Configured, Done, JobError, JobResult, Ping, Pong, Progress, Refused, Request, ShutdownFleet, Status, StatusReply, Stop, Stopped, Submit
from ..protocol.shm_lane import remove_dead_lanes, unlink_lane
from ..protocol.transport import HANDSHAKE_TIMEOUT_S, MAX_MESSAGE_BYTES, SOCKET_NAME, default_runtime_dir, ensure_private_dir, loads, read_or_create_key, send
from ..protocol import resources as R

if TYPE_CHECKING:
    from .fleet import Fleet

# No torch at this module's top (`.fleet`, `..protocol.frames` are imported where used): a spawned worker runs this
# module again as its `__mp_main__` before it can bind to this process (serving/worker_start.py), and a controller
# killed in that window must not leave it importing torch for seconds (issue 36).

log = logging.getLogger("ltx2_mgpu.controller")


class Controller:
    def __init__(self, runtime_dir: Path):
        self.runtime_dir = ensure_private_dir(runtime_dir)
        self.key = read_or_create_key(self.runtime_dir)
        self.socket_path = self.runtime_dir / SOCKET_NAME
        self.fleet: Fleet | None = None
        self.fleet_lock = threading.Lock()  # guards configure / run / shutdown of the fleet
        self.job_lock = threading.Lock()  # held while a job runs (busy check)
        self.state_lock = threading.Lock()  # guards current_job / current_kind against a racing cancel
        self.current_job: str | None = None  # the running job's id, or what the fleet is doing ("starting …")
        self.current_kind: str | None = None  # the running job's kind
        self.current_client: str | None = None  # who submitted the running job
        self.last_failure: str | None = None
        self.stopped_by: str | None = None  # "stop from pid N (name)" while a stop / shutdown_fleet tears down
        self.lost_reason: str | None = None  # why the last fleet was lost, until a new one starts (for the log)
        self.clients: dict[int, str] = {}  # id(connection) -> "pid N (name)" of every authenticated client
        self.stopping = threading.Event()
        self.test_faults = os.environ.get("LTX2_MGPU_TEST_FAULTS") == "1"
        self.pid_dir = self.runtime_dir / "workers"  # a pid file per worker until it is reaped
        self._reap_stale()

    def _reap_stale(self) -> None:
        """End the workers a previous controller of this runtime directory left (it died without reaping them),
        and the /dev/shm frames blocks they wrote."""
        stale = R.reap(self.pid_dir)
        for record in stale:
            log.warning("stale worker pid %d (rank %s of fleet generation %s, controller pid %s, which is gone): %s",
                        record["pid"], record.get("rank"), record.get("generation"), record.get("controller_pid"),
                        "ended" if record.get("was_running") else "had already exited")
        if stale:
            from ..protocol.frames import remove_orphans

            remove_orphans(tuple(r["pid"] for r in stale))
        remove_dead_lanes()  # shared-memory lanes of clients killed before a rank mapped them (shm_lane.py)

    def on_signal(self, signum: int, frame) -> None:
        """SIGTERM / SIGINT: end every worker this controller spawned (also one of a fleet still starting, from its
        pid file), log it, and stop serving."""
        ended = R.reap(self.pid_dir, own=True)
        log.warning("stopping on %s: ended worker pids %s", signal.Signals(signum).name,
                    [r["pid"] for r in ended if r.get("was_running")])
        self.stopping.set()
        raise SystemExit(128 + signum)

    # ---- serving ------------------------------------------------------------------------------------------------

    def serve(self) -> None:
        if self.socket_path.exists():
            self.socket_path.unlink()
        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            # no authkey here: Listener.accept() would run the handshake in this loop, where a client that never
            # answers blocks every other; each connection's thread authenticates it (_authenticate)
            listener = Listener(str(self.socket_path), family="AF_UNIX")
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        log.info("listening on %s (pid %d)", self.socket_path, os.getpid())
        try:
            while not self.stopping.is_set():
                try:
                    conn = listener.accept()
                except OSError as exc:  # e.g. out of file descriptors: keep serving the connections we have
                    log.warning("accept failed: %s", exc)
                    time.sleep(0.1)
                    continue
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            self._shutdown_fleet("the controller stops")

    def _authenticate(self, conn) -> None:
        """The HMAC challenge both ways (what `Listener.accept` does with an authkey), with a deadline on every
        read. Raises AuthenticationError (wrong key), OSError (timeout, client gone), EOFError."""
        sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket, to set its receive timeout
        try:
            seconds = HANDSHAKE_TIMEOUT_S
            timeout = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
            try:
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
            except BlockingIOError:
                raise TimeoutError(f"no answer to the auth challenge within {seconds:g} s") from None
            none = struct.pack("ll", 0, 0)  # authenticated: requests may come minutes apart
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, none)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, none)
        finally:
            sock.close()

    def _handle(self, conn) -> None:
        client = _peer(conn)
        try:
            self._authenticate(conn)
        except (AuthenticationError, OSError, EOFError) as exc:
            if not self.stopping.is_set():  # (stop wakes accept() with a connection that says nothing)
                log.warning("refused a connection from %s: %s", client, exc or type(exc).__name__)
            conn.close()
            return
        with self.state_lock:
            self.clients[id(conn)] = client
        try:
            while True:
                try:
                    data = conn.recv_bytes(MAX_MESSAGE_BYTES)
                except EOFError:
                    return
                except OSError as exc:
                    if exc.errno is None:  # "bad message length": over the limit; its bytes are still unread
                        log.warning("%s sent a message over %d bytes: closing its connection", client,
                                    MAX_MESSAGE_BYTES)
                        _send_quiet(conn, _protocol_error(f"message refused: longer than the controller's limit "
                                                          f"of {MAX_MESSAGE_BYTES} bytes (set "
                                                          f"LTX2_MGPU_MAX_MESSAGE_BYTES); the connection is closed"))
                    return
                request = _parse(data)
                if isinstance(request, str):  # unreadable: answered, and the next message is read as usual
                    log.warning("%s: %s", client, request)
                    _send_quiet(conn, _protocol_error(request))
                    continue
                if isinstance(request, Submit):
                    self._submit(conn, request, client)
                    continue
                try:
                    reply = self._simple(request, conn, client)
                except Exception as exc:  # noqa: BLE001 - a bug answering one request must not kill the connection
                    log.exception("%s: %s failed", client, type(request).__name__)
                    reply = Refused(f"{type(request).__name__} failed in the controller: {type(exc).__name__}: {exc}",
                                    ErrorKind.ERROR.value)
                if not _send_quiet(conn, reply):
                    return
                if isinstance(request, Stop):
                    self.stopping.set()
                    # unblock accept(): connect once to ourselves (the handshake is in the new connection's thread)
                    with socket.socket(socket.AF_UNIX) as wake:
                        try:
                            wake.connect(str(self.socket_path))
                        except OSError:
                            pass
                    return
        finally:
            with self.state_lock:
                self.clients.pop(id(conn), None)
            conn.close()

    def _others(self, conn) -> list[str]:
        """The other clients connected now (not `conn`)."""
        with self.state_lock:
            return [c for k, c in self.clients.items() if k != id(conn)]

    def _simple(self, request: Request, conn, client: str):
        """The reply to a request other than `Submit` (`messages.Reply`)."""
        if isinstance(request, Ping):
            return Pong(os.getpid())
        if isinstance(request, Status):
            return StatusReply(self.status())
        if isinstance(request, Configure):
            if not isinstance(request.config, FleetConfig):
                return Refused(f"configure needs a FleetConfig, got {type(request.config).__name__}",
                               ErrorKind.PROTOCOL.value)
            try:
                handle, replaced = self.configure(request.config, client, self._others(conn))
                return Configured(handle, replaced)
            except ControllerError as exc:
                return Refused(str(exc), exc.kind.value)
        if isinstance(request, Cancel):
            with self.state_lock:
                fleet = self.fleet
                if fleet is not None and self.current_job is not None and self.current_job == request.job_id:
                    fleet.cancel()
                    return Done()
            return Refused(f"no running job {request.job_id!r}", ErrorKind.ERROR.value)
        if not isinstance(request, (ShutdownFleet, Stop)):
            return Refused(f"unknown request {type(request).__name__}", ErrorKind.PROTOCOL.value)
        # the workers are gone when the client hears back
        op = "stop" if isinstance(request, Stop) else "shutdown_fleet"
        what = "the controller" if op == "stop" else "the fleet"
        stopped = FleetTeardown(self.fleet.describe() if self.fleet is not None and self.fleet.alive() else None,
                                tuple(self._others(conn)), self.busy_with() if self.current_job else None)
        self.stopped_by = f"{op} from {client}"
        try:
            if stopped.job:
                log.info("%s stops %s while %s runs (submitted by %s): cancelling it first", client, what,
                         stopped.job, self.current_client)
                with self.state_lock:
                    if self.fleet is not None and self.current_kind is not None:
                        self.fleet.cancel()  # it stops at its next step boundary, within the stop grace
            self._shutdown_fleet(self.stopped_by)
        finally:
            if op != "stop":
                self.stopped_by = None
        return Stopped(stopped)

    # ---- fleet --------------------------------------------------------------------------------------------------

    def status(self) -> ControllerStatus:
        fleet = self.fleet
        if fleet is not None and not fleet.alive():
            self._note_lost(fleet)
        with self.state_lock:
            clients = tuple(self.clients.values())
        return ControllerStatus(os.getpid(), str(self.socket_path), self.current_job, self.current_kind,
                                self.last_failure, clients,
                                None if fleet is None or not fleet.alive() else fleet.describe(), self.processes())

    def processes(self) -> tuple[ProcessInfo, ...]:
        """Every process this controller owns, itself first (`ProcessInfo`: role "controller", "worker rank R" or
        "helper (<its command line>)", e.g. multiprocessing's resource tracker; rss_bytes None off Linux)."""
        me, fleet = os.getpid(), self.fleet
        roles = {pid: f"worker rank {rank}" for rank, pid in enumerate(fleet.pids)} if fleet is not None else {}
        out = [ProcessInfo(me, "controller", R.rss_bytes(me))]
        for pid in sorted(set(R.children(me)) | {p for p in roles if R.start_time(p) is not None}):
            out.append(ProcessInfo(pid, roles.get(pid, f"helper ({R.command_line(pid)})"), R.rss_bytes(pid)))
        return tuple(out)

    def _note_lost(self, fleet: Fleet) -> None:
        """Record (once) why a fleet that is not alive died, e.g. a worker killed between jobs."""
        death = fleet.death()
        if death is not None and getattr(fleet, "_noted", None) != death:
            fleet._noted = death
            self.last_failure = self.lost_reason = death
            log.warning("fleet generation %d lost: %s", fleet.generation, death)

    def _start_fleet(self, config: FleetConfig, why: str) -> Fleet:
        """Start a fleet (caller holds fleet_lock) and log it. Raises ControllerError (fleet_lost)."""
        from .fleet import Fleet, next_generation

        t0 = time.monotonic()
        generation = next_generation()
        try:
            fleet = Fleet(config, generation, pid_dir=self.pid_dir)
        except ControllerError as exc:
            log.warning("fleet generation %d failed to start after %.1f s (%s) on %s: %s", generation,
                        time.monotonic() - t0, why, ",".join(config.devices), exc)
            raise
        log.info("fleet generation %d started (%s): %d rank(s) on %s, checkpoint %s, load %.1f s (ready after "
                 "%.1f s), pids %s", generation, why, config.world_size, ",".join(config.devices),
                 config.checkpoint, fleet.load_seconds, time.monotonic() - t0, list(fleet.pids))
        return fleet

    def _teardown(self, fleet: Fleet, why: str, graceful: bool = True) -> None:
        """Shut a fleet down (caller holds fleet_lock) and log it."""
        t0 = time.monotonic()
        fleet.shutdown(graceful=graceful)
        remove_dead_lanes()
        log.info("fleet generation %d torn down (%s): %d rank(s) on %s, in %.1f s", fleet.generation, why,
                 fleet.world_size, ",".join(fleet.config.devices), time.monotonic() - t0)

    def configure(self, config: FleetConfig, client: str = "a client",
                  others: list[str] | None = None) -> tuple[FleetHandle, FleetTeardown | None]:
        """Reuse the running fleet when its identity (`FleetConfig.identity`: model files, devices, dtype, …) is
        unchanged, or serves this one (`FleetIdentity.serves`: a whole-checkpoint fleet for a transformer-only
        configuration of the same transformer) — whatever the policy, which the returned handle carries to each of its jobs (no worker restarts,
        no file is read again by a worker) — else (re)build it. Refused while a job runs.

        Returns the handle and what was replaced: None, or a `FleetTeardown` (the old fleet, the other clients
        connected at the time). Raises ControllerError ("validation") for a configuration that
        cannot work (`check_config`), before anything running is touched."""
        if not self.job_lock.acquire(blocking=False):
            raise FleetBusy(f"the fleet is busy with {self.busy_with()}; try again when it ends (a cancelled "
                            f"job stops at its next denoising step; a first compiled job finishes compiling "
                            f"first)", kind=ErrorKind.BUSY)
        try:
            with self.state_lock:
                self.current_job = f"starting a {config.world_size}-rank fleet"  # what status / busy answers show
                self.current_client = client
            with self.fleet_lock:
                fleet = self.fleet
                # the same identity, or a whole-checkpoint fleet serving a transformer-only one of the same
                # transformer (`FleetIdentity.serves`: both loaders of one prompt share one fleet)
                kept = fleet is not None and fleet.alive() and fleet.identity.serves(config.identity)
                # headers and host limits, before any worker starts; nothing running is touched. A fleet this one
                # replaces gives its workers' memory back first.
                freed = 0 if kept or fleet is None else sum(R.rss_bytes(p) or 0 for p in fleet.pids)
                check_config(config, freed_bytes=freed, memory=not kept)
                if kept:
                    if fleet.identity != config.identity:
                        log.info("fleet generation %d kept for %s: it holds the whole checkpoint and serves the "
                                 "transformer-only configuration of the same file", fleet.generation, client)
                    if config.policy != fleet.config.policy:
                        log.info("fleet generation %d kept for %s: a policy change only (%s)", fleet.generation,
                                 client, _policy_change(fleet.config.policy, config.policy))
                    return FleetHandle(fleet.generation, config, fleet.pids, fleet.plan_for(config.policy)), None
                replaced = None
                if fleet is not None:
                    if fleet.alive():
                        replaced = FleetTeardown(fleet.describe(), tuple(others or ()))
                        self._teardown(fleet, f"replaced by another configuration from {client}")
                    else:
                        self._note_lost(fleet)
                        self._teardown(fleet, "lost", graceful=False)
                    self.fleet = None
                self.fleet = self._start_fleet(config, f"configure from {client}")
                return (FleetHandle(self.fleet.generation, config, self.fleet.pids,
                                    self.fleet.plan_for(config.policy)), replaced)
        finally:
            with self.state_lock:
                self.current_job = self.current_client = None
            self.job_lock.release()

    def _shutdown_fleet(self, why: str) -> None:
        with self.fleet_lock:
            if self.fleet is not None:
                if not self.fleet.alive():
                    self._note_lost(self.fleet)
                self._teardown(self.fleet, why, graceful=self.fleet.alive())
                self.fleet = None

    def _submit(self, conn, request: Submit, client: str) -> None:
        handle, spec = request.handle, request.job
        if not isinstance(handle, FleetHandle) or not isinstance(spec, JobSpec):
            _send_quiet(conn, _protocol_error(f"submit needs a FleetHandle 'handle' and a JobSpec 'job', got "
                                              f"{type(handle).__name__} and {type(spec).__name__}"))
            return
        t0 = time.monotonic()
        if not self.job_lock.acquire(blocking=False):
            running = self.busy_with()
            _send_quiet(conn, Busy(spec.job_id, running))
            log.info("job %s %s from %s: refused, busy with %s", spec.job_id, spec.kind, client, running)
            return
        final: JobResult | JobError | None = None
        try:
            final = self._run_job(conn, handle, spec, client)
        except BaseException as exc:  # a bug: the client still gets an answer, the job lock is released
            log.exception("job %s failed in the controller", spec.job_id)
            final = _error(spec, f"the controller failed running the job: {type(exc).__name__}: {exc}",
                           ErrorKind.ERROR)
        finally:
            lane = getattr(spec.payload, "lane", None)  # a `Pickled` payload's shared-memory lane (shm_lane.py)
            if lane is not None:  # every rank has mapped it by now (or never will): its name goes
                try:
                    unlink_lane(lane.name)
                except (ValueError, TypeError, AttributeError, OSError) as exc:
                    log.warning("job %s: its lane %r: %s", spec.job_id, lane, exc)
            with self.state_lock:
                self.current_job = self.current_kind = self.current_client = None
            self.job_lock.release()
        if isinstance(final, JobResult):
            outcome = "done"
        elif final.kind == ErrorKind.CANCELLED:
            outcome = "cancelled"
        else:
            outcome = f"{final.kind}{' (fleet lost)' if final.fleet_lost else ''}: {final.message}"
        # the job's line is in the log before its client has the answer
        log.info("job %s %s from %s: %.2f s, %s", spec.job_id, spec.kind, client, time.monotonic() - t0, outcome)
        # released first: a client submitting again the moment it reads this answer finds the fleet free
        if not _send_quiet(conn, final) and isinstance(final, JobResult):
            from ..protocol.frames import free_frames

            free_frames(final.result)  # the client went away: nobody will read (and unlink) the frames
            log.info("job %s: its client had gone; its frames were freed", spec.job_id)

    def _run_job(self, conn, handle: FleetHandle, spec: JobSpec, client: str) -> JobResult | JobError:
        """Run one job (the caller holds job_lock); returns its final event (result or error), not yet sent.

        The fleet's cancel flag is cleared when the job becomes current (under state_lock, as `cancel` checks it):
        a cancel for this job that arrives at any later moment stops it; one for an earlier job never does."""
        with self.state_lock:  # busy answers name this job also while a lost fleet is started again for it
            self.current_job, self.current_kind, self.current_client = spec.job_id, spec.kind, client
            fleet = self.fleet
            if fleet is not None:
                fleet.cancel_flag.value = 0
        if fleet is not None and fleet.alive() and not fleet.identity.serves(handle.config.identity):
            return _error(spec, f"fleet handle of generation {handle.generation} is stale: the fleet was rebuilt "
                                f"with another configuration (generation {fleet.generation}); load the checkpoint "
                                f"again", ErrorKind.STALE_HANDLE)
        # a live fleet of the handle's identity serves it (under the handle's policy), also one rebuilt after a
        # failure (generation + 1): the model is the same. A lost fleet is started again with the handle's config.
        if fleet is None or not fleet.alive():
            with self.fleet_lock:
                if fleet is not None:
                    self._note_lost(fleet)
                    self._teardown(fleet, "lost", graceful=False)
                why = (f"the previous fleet was lost: {self.lost_reason}" if self.lost_reason
                       else "first job of its configuration")
                self.lost_reason = None
                with self.state_lock:
                    self.fleet = None  # a cancel now is answered "no running job" (the client asks again)
                try:
                    fleet = self._start_fleet(handle.config, f"job {spec.job_id} from {client}; {why}")
                    with self.state_lock:
                        self.fleet = fleet
                except ControllerError as exc:
                    self.last_failure = str(exc)
                    return _error(spec, str(exc), exc.kind, fleet_lost=True)
        if spec.fault is not None and not self.test_faults:
            spec = replace(spec, fault=None)
        _send_quiet(conn, Accepted(spec.job_id, fleet.generation, tuple(fleet.pids)))
        gone: list[bool] = []

        def forward_event(event: Progress) -> None:
            # a client that went away (killed, its terminal closed) reads nothing more: its job is cancelled at the
            # next step instead of holding the fleet, every other client told "busy", until it ends for nobody
            if not _send_quiet(conn, event) and not gone:
                gone.append(True)
                log.info("job %s: its client %s went away: cancelling the job", spec.job_id, client)
                fleet.cancel()

        try:
            result = fleet.run(spec, on_event=forward_event, policy=handle.config.policy)
            return JobResult(spec.job_id, result)
        except ControllerError as exc:
            message = str(exc)
            stopped_by = self.stopped_by
            if stopped_by is not None and (exc.fleet_lost or isinstance(exc, JobCancelled)):
                return _error(spec, f"the fleet was stopped while this job ran ({stopped_by}): the job did not "
                                    f"finish", ErrorKind.FLEET_STOPPED, fleet_lost=True)
            if exc.fleet_lost:
                self.last_failure = self.lost_reason = message
                log.warning("fleet generation %d lost during job %s: %s", fleet.generation, spec.job_id, message)
                with self.fleet_lock:
                    if self.fleet is fleet:
                        self.fleet = None
            return _error(spec, message, exc.kind, exc.fleet_lost, exc.details)

    def busy_with(self) -> str:
        """What the fleet is doing, for busy answers: "a generate job (id)", or "starting a N-rank fleet"."""
        kind, job = self.current_kind, self.current_job
        if kind is not None:
            return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} job ({job})"
        return job or "another job"


def _peer(conn) -> str:
    """"pid N (name)" of the process at the other end of a Unix socket (SO_PEERCRED), for the log and status."""
    pid = R.peer_pid(conn)
    if pid is None:  # not Linux: no SO_PEERCRED
        return f"connection {id(conn):x}"
    name = R.process_name(pid)
    return f"pid {pid}" if name == "?" else f"pid {pid} ({name})"


def _parse(data: bytes) -> Request | str:
    """A request (`messages.Request`), or the reason it is not one."""
    try:
        request = loads(data)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is the sender's error
        return f"malformed message ({len(data)} bytes): cannot unpickle it ({type(exc).__name__}: {exc})"
    if not isinstance(request, Request):
        return (f"malformed request: expected a request of protocol.messages (Ping, Status, Configure, Submit, "
                f"Cancel, ShutdownFleet, Stop), got {type(request).__name__} {repr(request)[:80]}")
    return request


def _protocol_error(message: str) -> Refused:
    """An answer both client paths read: a request's reply and a job's stream."""
    return Refused(message, ErrorKind.PROTOCOL.value)


def check_config(config: FleetConfig, freed_bytes: int = 0, memory: bool = True) -> None:
    """Checks that need only file headers and the host, before any worker starts (so a running fleet is not torn
    down for a configuration that cannot work): the host can run the fleet (`resources.check_fleet`: ranks, GPUs,
    cores; host memory unless memory=False, with `freed_bytes` given back by a fleet this one replaces), the
    checkpoint is a readable LTX-2 file (`models.headers.checkpoint_facts`), and the fleet's rules hold for its
    heads (`fleet_rules.check_fleet`: degrees and heads, sharded weights × the split and × compile, int8 modes, an
    explicit `int8_compute` on a file with no int8 layers).
    (Each field's own rule — a known guidance-parallel mode, a non-negative token minimum, … — is checked when the
    `FleetIdentity` / `FleetPolicy` is built.)

    Raises ControllerError (kind "validation") naming the file or the value and the rule."""
    # header reads (no torch, no model class) and the rules
    from ..models.headers import CheckpointError, checkpoint_facts
    from ..protocol.fleet_rules import check_fleet
    from ..protocol.validation import ValidationError

    for what, path in (("checkpoint", config.checkpoint), ("upscaler", config.upscaler),
                       ("video_vae", config.video_vae), ("audio_vae", config.audio_vae),
                       ("text_projection", config.text_projection)):
        if path and Path(path).is_dir():
            raise ControllerError(f"{what}: {path} is a directory, not a file: give the .safetensors file in it",
                                  kind=ErrorKind.VALIDATION)
    try:  # sizes only (no file is opened): a checkpoint larger than the host's memory is not even mapped
        if memory:
            R.check_fleet(config, freed_bytes=freed_bytes)
        else:
            R.check_rank_count(config.devices, config.threads_per_worker)
    except R.FleetTooLarge as exc:
        raise ControllerError(str(exc), kind=ErrorKind.VALIDATION) from None
    try:
        facts = checkpoint_facts(config.checkpoint)
        check_fleet(config.identity, config.policy, facts=facts)  # with the header: an int8 switch needs int8 layers
    except (ValidationError, CheckpointError, FileNotFoundError) as exc:
        raise ControllerError(str(exc), kind=ErrorKind.VALIDATION) from None


def _policy_change(old: FleetPolicy, new: FleetPolicy) -> str:
    """"sp_degree None -> 2, compile False -> True" for the log."""
    return ", ".join(f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}" for f in fields(FleetPolicy)
                     if getattr(old, f.name) != getattr(new, f.name))


def _error(spec: JobSpec, message: str, kind: ErrorKind, fleet_lost: bool = False,
           details: ErrorDetails | None = None) -> JobError:
    """A job's final error event; `kind` travels as its plain string value."""
    return JobError(spec.job_id, message, ErrorKind(kind).value, fleet_lost, details or ErrorDetails())


def _send_quiet(conn, event) -> bool:
    """Send; a client that went away is not an error here (False: gone; a running job's caller cancels it)."""
    try:
        send(conn, event)
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend.serving.controller")
    parser.add_argument("--runtime-dir", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    R.set_process_name("ltx2mgpu-ctl")
    controller = Controller(Path(args.runtime_dir) if args.runtime_dir else default_runtime_dir())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, controller.on_signal)
    controller.serve()


if __name__ == "__main__":
    main()
