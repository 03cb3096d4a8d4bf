"""The background controller: holds the worker fleet, serves clients on a private Unix socket.

Started by `client.connect()` as `python -m mgpu_backend.controller --runtime-dir DIR` with the caller's Python and
an explicit PYTHONPATH, in its own session (it outlives the ComfyUI process or CLI that started it, so a second
client reattaches). One job at a time: a `submit` while a job runs is answered `busy` at once.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from multiprocessing.connection import Listener
from pathlib import Path

from . import protocol as P
from .fleet import Fleet, next_generation

log = logging.getLogger("ltx2_mgpu.controller")


class Controller:
    def __init__(self, runtime_dir: Path):
        self.runtime_dir = P.ensure_private_dir(runtime_dir)
        self.key = P.read_or_create_key(self.runtime_dir)
        self.socket_path = self.runtime_dir / P.SOCKET_NAME
        self.fleet: Fleet | None = None
        self.fleet_lock = threading.Lock()  # guards configure / run / shutdown of the fleet
        self.job_lock = threading.Lock()  # held while a job runs (busy check)
        self.current_job: str | None = None  # the running job's id, or what the fleet is doing ("starting …")
        self.current_kind: str | None = None  # the running job's kind
        self.last_failure: str | None = None
        self.stopping = threading.Event()
        self.test_faults = os.environ.get("LTX2_MGPU_TEST_FAULTS") == "1"

    # ---- serving ------------------------------------------------------------------------------------------------

    def serve(self) -> None:
        if self.socket_path.exists():
            self.socket_path.unlink()
        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            listener = Listener(str(self.socket_path), family="AF_UNIX", authkey=self.key)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        log.info("listening on %s (pid %d)", self.socket_path, os.getpid())
        try:
            while not self.stopping.is_set():
                try:
                    conn = listener.accept()
                except Exception as exc:  # wrong auth key, client gone during the handshake
                    log.warning("refused a connection: %s", exc)
                    continue
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            listener.close()
            self._shutdown_fleet()

    def _handle(self, conn) -> None:
        try:
            while True:
                try:
                    request = P.recv(conn)
                except (EOFError, OSError):
                    return
                op = request.get("op")
                if op == "submit":
                    self._submit(conn, request)
                    continue
                P.send(conn, self._simple(op, request))
                if op == "stop":
                    self.stopping.set()
                    # unblock accept(): connect once to ourselves
                    try:
                        from multiprocessing.connection import Client

                        Client(str(self.socket_path), family="AF_UNIX", authkey=self.key).close()
                    except OSError:
                        pass
                    return
        finally:
            conn.close()

    def _simple(self, op: str, request: dict) -> dict:
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op == "status":
            return {"ok": True, **self.status()}
        if op == "configure":
            try:
                return {"ok": True, "handle": self.configure(request["config"])}
            except P.ControllerError as exc:
                return {"ok": False, "error": str(exc), "kind": exc.kind}
        if op == "cancel":
            fleet = self.fleet
            if fleet is not None and self.current_job == request.get("job_id"):
                fleet.cancel()
                return {"ok": True}
            return {"ok": False, "error": f"no running job {request.get('job_id')!r}"}
        if op == "shutdown_fleet":
            self._shutdown_fleet()
            return {"ok": True}
        if op == "stop":  # the workers are gone when the client hears back (a new fleet may take the devices)
            self._shutdown_fleet()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ---- fleet --------------------------------------------------------------------------------------------------

    def status(self) -> dict:
        fleet = self.fleet
        return {"pid": os.getpid(), "socket": str(self.socket_path), "busy_job": self.current_job,
                "last_failure": self.last_failure,
                "fleet": None if fleet is None or not fleet.alive() else {
                    "generation": fleet.generation, "devices": list(fleet.config.devices),
                    "worker_pids": list(fleet.pids), "checkpoint": fleet.config.checkpoint,
                    "load_seconds": fleet.load_seconds, "open_counts": list(fleet.open_counts)}}

    def configure(self, config: P.FleetConfig) -> P.FleetHandle:
        """Reuse the fleet when the configuration is unchanged, else (re)build it. Refused while a job runs."""
        if not self.job_lock.acquire(blocking=False):
            raise P.FleetBusy(f"the fleet is busy with {self.busy_with()}; try again when it ends (a cancelled "
                              f"job stops at its next denoising step; a first compiled job finishes compiling "
                              f"first)", kind="busy")
        try:
            self.current_job = f"starting a {config.world_size}-rank fleet"  # what status / busy answers show
            with self.fleet_lock:
                fleet = self.fleet
                if fleet is not None and fleet.alive() and fleet.config == config:
                    return P.FleetHandle(fleet.generation, config, fleet.pids)
                check_config(config)  # before any worker starts; nothing running is touched
                if fleet is not None:
                    fleet.shutdown()
                    self.fleet = None
                self.fleet = Fleet(config, next_generation())
                return P.FleetHandle(self.fleet.generation, config, self.fleet.pids)
        finally:
            self.current_job = None
            self.job_lock.release()

    def _shutdown_fleet(self) -> None:
        with self.fleet_lock:
            if self.fleet is not None:
                self.fleet.shutdown()
                self.fleet = None

    def _submit(self, conn, request: dict) -> None:
        handle: P.FleetHandle = request["handle"]
        spec: P.JobSpec = request["job"]
        if not self.job_lock.acquire(blocking=False):
            P.send(conn, {"event": "busy", "job_id": spec.job_id, "running": self.busy_with()})
            return
        try:
            fleet = self.fleet
            if fleet is not None and fleet.alive() and fleet.config != handle.config:
                P.send(conn, _error(spec, f"fleet handle of generation {handle.generation} is stale: the fleet was "
                                       f"rebuilt with another configuration (generation {fleet.generation}); load "
                                       f"the checkpoint again", "stale_handle"))
                return
            # a live fleet of the handle's config serves it, also one rebuilt after a failure (generation + 1): the
            # model is the same. A lost fleet is started again with the handle's config.
            if fleet is None or not fleet.alive():
                with self.fleet_lock:
                    if fleet is not None:
                        fleet.shutdown(graceful=False)
                    try:
                        self.fleet = fleet = Fleet(handle.config, next_generation())
                    except P.ControllerError as exc:
                        self.fleet, self.last_failure = None, str(exc)
                        P.send(conn, _error(spec, str(exc), exc.kind, fleet_lost=True))
                        return
            if spec.fault and not self.test_faults:
                spec.fault = None
            self.current_job, self.current_kind = spec.job_id, spec.kind
            P.send(conn, {"event": "accepted", "job_id": spec.job_id, "generation": fleet.generation,
                       "worker_pids": list(fleet.pids)})
            try:
                result = fleet.run(spec, on_event=lambda event: _send_quiet(conn, event))
                try:
                    P.send(conn, {"event": "result", "job_id": spec.job_id, "result": result})
                except OSError:  # the client went away: nobody will read (and unlink) the frames block
                    _free_frames(result)
                    raise
            except P.ControllerError as exc:
                if exc.fleet_lost:
                    self.last_failure = str(exc)
                    self.fleet = None
                _send_quiet(conn, _error(spec, str(exc), exc.kind, exc.fleet_lost, exc.details))
        finally:
            self.current_job = self.current_kind = None
            self.job_lock.release()

    def busy_with(self) -> str:
        """What the fleet is doing, for busy answers: "a generate job (id)", or "starting a N-rank fleet"."""
        if self.current_kind is not None:
            return f"a {self.current_kind} job ({self.current_job})"
        return self.current_job or "another job"


def check_config(config: P.FleetConfig) -> None:
    """Checks that need only file headers, before any worker starts (so a running fleet is not torn down for a
    configuration that cannot work): the checkpoint is a readable LTX-2 file, and an explicit SP degree divides its
    heads and fits the ranks; `guidance_parallel` is a known mode; `min_tokens_per_rank` is not negative.

    Raises ControllerError (kind "validation") naming the file or the value and the rule."""
    from .models.loader import CheckpointError, SafetensorsFile, transformer_prefix
    from .parallel.passes import check_mode
    from .parallel.plan import check_requested_degree
    from .validation import ValidationError

    try:
        check_mode(config.guidance_parallel)
    except ValueError as exc:
        raise P.ControllerError(str(exc), kind="validation") from None
    if config.min_tokens_per_rank is not None and config.min_tokens_per_rank < 0:
        raise P.ControllerError(f"min_tokens_per_rank={config.min_tokens_per_rank}: must be 0 (always every rank) or "
                                f"a positive video-token count", kind="validation")
    try:
        header = SafetensorsFile(config.checkpoint)
        transformer_prefix(header)
        if config.sp_degree is not None:
            heads = int(header.config().get("transformer", {}).get("num_attention_heads", 32))
            check_requested_degree(heads, config.sp_degree, config.world_size)
    except (ValidationError, CheckpointError, FileNotFoundError) as exc:
        raise P.ControllerError(str(exc), kind="validation") from None


def _error(spec: P.JobSpec, message: str, kind: str, fleet_lost: bool = False, details: dict | None = None) -> dict:
    return {"event": "error", "job_id": spec.job_id, "message": message, "kind": kind, "fleet_lost": fleet_lost,
            "details": details or {}}


def _free_frames(result) -> None:
    if isinstance(result, dict) and isinstance(result.get("frames"), dict):
        from multiprocessing import shared_memory

        try:
            shm = shared_memory.SharedMemory(name=result["frames"]["name"])
            shm.close()
            shm.unlink()
        except FileNotFoundError:
            pass


def _send_quiet(conn, event: dict) -> None:
    """Progress to a client that went away is dropped; the job goes on."""
    try:
        P.send(conn, event)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend.controller")
    parser.add_argument("--runtime-dir", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    Controller(Path(args.runtime_dir) if args.runtime_dir else P.default_runtime_dir()).serve()


if __name__ == "__main__":
    main()
